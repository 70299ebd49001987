"""Errors raised for bad user input. Each message names the field, the bad value and the fix."""


class DFlashError(ValueError):
    """Base class for every user-facing vllm-dflash error."""


class DFlashConfigError(DFlashError):
    """A drafter or serving config is malformed or incompatible with its target."""


class DFlashCheckpointError(DFlashError):
    """A drafter checkpoint is missing, corrupted, or does not match its config."""


class DFlashDataError(DFlashError):
    """A prompt or training-data file is missing or malformed."""
