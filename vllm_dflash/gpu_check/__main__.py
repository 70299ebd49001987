"""``python -m vllm_dflash.gpu_check``: the same as ``vllm-dflash gpu-check``."""

import sys

from vllm_dflash.gpu_check.run import main

sys.exit(main())
