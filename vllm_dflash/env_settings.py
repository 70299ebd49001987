"""Settings read from ``VLLM_DFLASH_<FIELD>`` environment variables.

Environment variables reach every vLLM process (API server, engine core, workers), which a
``--speculative-config`` key of ours would not: vLLM rejects keys it does not know.
"""

from __future__ import annotations

import os
from typing import Self

from pydantic import BaseModel, ConfigDict, ValidationError

from vllm_dflash.errors import DFlashConfigError

ENV_PREFIX = "VLLM_DFLASH_"


class EnvSettings(BaseModel):
    """Subclasses declare fields with a ``description`` (used in the error's fix)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Self:
        env = os.environ if environ is None else environ
        raw = {
            name: env[ENV_PREFIX + name.upper()]
            for name in cls.model_fields
            if ENV_PREFIX + name.upper() in env
        }
        try:
            return cls(**raw)
        except ValidationError as e:
            err = e.errors()[0]
            name = str(err["loc"][0])
            field = cls.model_fields[name]
            raise DFlashConfigError(
                f"{ENV_PREFIX + name.upper()}={raw.get(name)!r}: {err['msg']}. Fix: set it to "
                f"{field.description} (default {field.default}), or unset it"
            ) from None
