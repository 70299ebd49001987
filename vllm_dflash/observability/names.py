"""Names, labels and buckets of the metrics we export, shared by the stat logger, the
dashboard generator, the alert rules and the tests (one place to rename a metric).

Acceptance counters are vLLM's own and are not duplicated: ``vllm:spec_decode_*``.
"""

from __future__ import annotations

PREFIX = "vllm_dflash_"
LABELS = ("model_name", "engine")

REQUEST_ACCEPTANCE_LENGTH = PREFIX + "request_acceptance_length"
REQUEST_SPEEDUP = PREFIX + "request_speedup"
DRAFTER_STEP_SECONDS = PREFIX + "drafter_step_seconds"
VERIFY_STEP_SECONDS = PREFIX + "verify_step_seconds"
BASELINE_STEP_SECONDS = PREFIX + "baseline_step_seconds"
BASELINE_SAMPLES = PREFIX + "baseline_samples_total"
ACCEPTANCE_LENGTH_FLOOR = PREFIX + "acceptance_length_floor"
DRAFTER_FAULTS = PREFIX + "drafter_faults_total"
DRAFTER_OFF = PREFIX + "drafter_off"

# vLLM's own series that the dashboard and the alerts read.
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens_total"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"

# Tokens per verify step: 1 (nothing accepted) up to K + 1 (block 16 -> 16).
ACCEPTANCE_LENGTH_BUCKETS = (
    1.0,
    1.25,
    1.5,
    1.75,
    2.0,
    2.25,
    2.5,
    2.75,
    3.0,
    3.5,
    4.0,
    4.5,
    5.0,
    6.0,
    7.0,
    8.0,
    10.0,
    12.0,
    16.0,
)
SPEEDUP_BUCKETS = (
    0.25,
    0.5,
    0.6,
    0.7,
    0.8,
    0.9,
    1.0,
    1.1,
    1.2,
    1.3,
    1.5,
    1.75,
    2.0,
    2.5,
    3.0,
    3.5,
    4.0,
    5.0,
    6.0,
    8.0,
)
STEP_SECONDS_BUCKETS = (
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
    5.0,
)
