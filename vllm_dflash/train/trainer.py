"""``vllm-dflash train``: the paper's recipe (docs/architecture.md §3) for a DFlash drafter.

Per optimizer step (x ``grad_accum`` micro-batches of ``batch_size`` sequences):

1. target features of every position: the frozen target online, or memory-mapped shards;
2. ``blocks_per_seq`` anchors per sequence in its response (random, or the fixed grid);
3. one drafter forward over all blocks: each block = clean anchor + B-1 <mask>, attending to
   context features before its anchor and to its own block (blocks.py);
4. the target's frozen LM head on mask slots; CE weighted exp(-(k-1)/gamma_d) (loss.py).

Only the drafter trains; the target's embedding and LM head are used, never stored. The
drafter is exported in the z-lab format (config.json + model.safetensors) that vLLM's
built-in ``dflash`` and our plugin both load. A checkpoint holds the model, optimizer,
schedule, every RNG and the log, so a resumed run continues the same loss curve.

Under ``torchrun`` the ranks share each global micro-batch (``distributed.py``): the same
curve at any number of ranks, and checkpoints that resume on another number.
"""

from __future__ import annotations

import json
import math
import pickle
import random
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_dflash.bench.acceptance import AcceptanceReport, measure
from vllm_dflash.checkpoint import load_drafter_checkpoint, save_drafter_checkpoint
from vllm_dflash.config import DrafterConfig, TargetConfig, check_compatible, read_json
from vllm_dflash.data import prompt_format
from vllm_dflash.data.records import encode_prompt, read_prompts, read_samples
from vllm_dflash.errors import DFlashConfigError, DFlashDataError
from vllm_dflash.reference.drafter import ReferenceDrafter
from vllm_dflash.reference.model import DFlashDrafter
from vllm_dflash.reference.target import HFTarget
from vllm_dflash.train import blocks, distributed
from vllm_dflash.train.config import TrainConfig
from vllm_dflash.train.drafter_init import new_drafter_config
from vllm_dflash.train.features import OfflineFeatures, target_features
from vllm_dflash.train.loss import LossSums, block_loss_sums, decay_weights, default_decay_gamma

CHECKPOINT = "checkpoint/state.pt"
# 2: model and optimizer states keyed by parameter name, unsharded (any number of ranks).
CHECKPOINT_FORMAT = 2
# Settings a resumed run may change: they do not touch the weights or the loss curve.
_BOOKKEEPING = {
    "resume",
    "stop_after",
    "parallel",
    "eval_every",
    "save_every",
    "eval_num_prompts",
    "eval_max_tokens",
    "export_dtype",
}
LOG = prompt_format.TRAIN_LOG
PLOT = "training.png"


def load_state(path: Path) -> dict:
    """A training checkpoint, on the CPU whatever device wrote it. Only tensors and plain
    data load (``weights_only``): a pickle that would construct anything else, and so could
    run code, is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise DFlashDataError(
            f"{path}: refused, it holds objects other than tensors and plain data, and "
            f"loading it could run code ({str(e).splitlines()[0]}). Fix: resume only from "
            "checkpoints this trainer wrote, or start fresh without --resume"
        ) from None


@dataclass
class Sample:
    id: str
    prompt_len: int
    ids: list[int]


def _mask_token_id(target_dir: Path, vocab_size: int) -> int:
    """The tokenizer's mask token when it has one, else the last id (a reserved slot in
    most vocabularies); the drafter only needs an id the target never emits."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    mask = getattr(tok, "mask_token_id", None)
    return mask if mask is not None and mask < vocab_size else vocab_size - 1


def drafter_config(cfg: TrainConfig) -> DrafterConfig:
    """The drafter's config, checked against the target before any training step."""
    target_raw = read_json(cfg.target / "config.json")
    target_cfg = TargetConfig.from_dict(target_raw, source=str(cfg.target / "config.json"))
    if cfg.init_from is not None:
        dcfg = load_drafter_checkpoint(cfg.init_from).config
    else:
        dcfg = new_drafter_config(
            target_raw,
            block_size=cfg.block_size,
            num_layers=cfg.num_layers,
            num_feature_layers=cfg.num_feature_layers,
            target_layer_ids=cfg.target_layer_ids,
            intermediate_size=cfg.intermediate_size,
            mask_token_id=cfg.mask_token_id
            if cfg.mask_token_id is not None
            else _mask_token_id(cfg.target, target_cfg.vocab_size),
        )
    check_compatible(dcfg, target_cfg)
    return dcfg


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.ranks = distributed.from_env()
        distributed.check_batch(cfg.batch_size, self.ranks)
        self.dcfg = drafter_config(cfg)
        self.device = distributed.device(self.ranks)
        # bf16 runs keep the frozen target in bf16 too (half the memory); fp32 master
        # weights for the drafter either way.
        target_dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
        self.target = HFTarget.from_pretrained(cfg.target, dtype=target_dtype)
        self.target.model.to(self.device)
        self.layers = self.dcfg.target_layer_ids
        self.block = self.dcfg.block_size
        self.block_sizes = cfg.train_block_sizes or [self.block]
        if max(self.block_sizes) > self.block:
            raise DFlashConfigError(
                f"field 'train_block_sizes' = {cfg.train_block_sizes} exceeds the drafter's "
                f"block_size {self.block}. Fix: list sizes <= {self.block}"
            )
        decay_gamma = (
            (cfg.decay_gamma or default_decay_gamma(self.block)) if cfg.loss_decay else None
        )
        self.decay_gamma = decay_gamma
        self.weights = decay_weights(self.block, decay_gamma).to(self.device)
        self.use_flex = self._pick_attention()

        self.samples, self.eval_prompts = self._load_data()
        self.features = OfflineFeatures(cfg.features) if cfg.features else None
        if self.features is not None:
            self.features.check(self.layers, [s.id for s in self.samples])

        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.model = DFlashDrafter(self.dcfg).to(self.device)
        if cfg.init_from is not None:
            self.model.load_state_dict(load_drafter_checkpoint(cfg.init_from).state_dict)
        self.model.float().train()
        # DDP wraps the drafter; FSDP shards it in place (before the optimizer sees it).
        self.step_model = distributed.wrap(self.model, self.ranks, cfg.parallel)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95)
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)
        self.rng = random.Random(cfg.seed)  # anchors
        self.data_gen = torch.Generator().manual_seed(cfg.seed)  # batch order
        self.step = 0
        self.log: dict[str, list] = {"step": [], "loss": [], "lr": [], "eval": []}
        if cfg.resume:
            self._load_checkpoint()

    # -- setup -------------------------------------------------------------------------

    def _pick_attention(self) -> bool:
        mode = self.cfg.attention
        if mode == "flex" and not blocks.flex_available():
            raise DFlashConfigError(
                "field 'attention' = 'flex' but this torch has no flex attention. "
                "Fix: set attention to 'dense' or 'auto'"
            )
        if mode == "flex" and self.device.type == "cpu":
            # torch raises "FlexAttention does not support backward on CPU" mid-step.
            raise DFlashConfigError(
                "field 'attention' = 'flex' needs a GPU: this torch's flex attention has no "
                "backward pass on CPU. Fix: set attention to 'dense' or 'auto'"
            )
        # On GPU flex attention skips fully masked tiles (most of them: blocks are isolated).
        return mode == "flex" or (
            mode == "auto" and blocks.flex_available() and self.device.type == "cuda"
        )

    def _load_data(self) -> tuple[list[Sample], list[list[int]]]:
        cfg = self.cfg
        samples = []
        too_short = 0
        records = read_samples(cfg.data, strict=cfg.strict, vocab_size=self.dcfg.vocab_size)
        # How the data's prompts were formatted: kept in the log for `eval`, and used for
        # the eval prompts here, so that both see what the target saw in the data.
        self.prompt_formats = prompt_format.of_samples(r.data for r in records)
        thinking = {f["enable_thinking"] for f in self.prompt_formats if f["chat_template"]}
        for r in records:
            ids = (r.data["prompt_token_ids"] + r.data["response_token_ids"])[: cfg.max_seq_len]
            p = len(r.data["prompt_token_ids"])
            if len(ids) - 2 < p:  # no anchor with a label inside max_seq_len
                too_short += 1
                continue
            samples.append(Sample(str(r.data.get("id", r.id)), p, ids))
        if too_short and self.ranks.main:
            print(f"warning: {too_short} samples have no response inside max_seq_len; skipped")
        if cfg.eval_prompts is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(cfg.target))
            recs = read_prompts(
                cfg.eval_prompts, strict=cfg.strict, vocab_size=self.dcfg.vocab_size
            )[: cfg.eval_num_prompts]
            on = thinking.pop() if len(thinking) == 1 else None
            eval_prompts = [encode_prompt(tok, r.data, on) for r in recs]
        else:  # hold the last samples out: their prompts are never trained on
            if len(samples) <= cfg.eval_num_prompts:
                raise DFlashDataError(
                    f"{cfg.data}: {len(samples)} usable samples cannot spare "
                    f"eval_num_prompts={cfg.eval_num_prompts} for eval. Fix: set eval_prompts "
                    "or lower eval_num_prompts"
                )
            held = samples[-cfg.eval_num_prompts :]
            samples = samples[: -cfg.eval_num_prompts]
            eval_prompts = [s.ids[: s.prompt_len] for s in held]
        if not samples:
            raise DFlashDataError(f"{cfg.data}: no usable samples. Fix: regenerate the data")
        return samples, eval_prompts

    def _lr_factor(self, step: int) -> float:
        w, total = self.cfg.warmup_steps, self.cfg.steps
        if step < w:
            return (step + 1) / w
        t = (step - w) / max(1, total - w)
        floor = self.cfg.min_lr_ratio
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    # -- one step ----------------------------------------------------------------------

    def batch_loss(self, batch: list[Sample]) -> LossSums:
        """This rank's share of one global micro-batch ``batch``, as loss sums."""
        dev, B = self.device, self.block
        # Every rank draws the anchors of the whole batch: the random streams stay the same
        # on all ranks, whatever their number.
        anchors_of = [
            blocks.sample_anchors(
                self.rng, s.prompt_len, len(s.ids), B, self.cfg.blocks_per_seq, self.cfg.anchors
            )
            for s in batch
        ]
        # Only sizes other than the block draw lengths: [B] keeps the anchors' random stream.
        mixed = set(self.block_sizes) != {B}
        lens_of = [
            blocks.sample_block_lens(self.rng, len(a), self.block_sizes) if mixed else []
            for a in anchors_of
        ]
        batch, per_seq = self.ranks.slice(batch), self.ranks.slice(anchors_of)
        per_seq_lens = self.ranks.slice(lens_of)
        T = max(len(s.ids) for s in batch)
        seqs = torch.zeros(len(batch), T, dtype=torch.long)
        for i, s in enumerate(batch):
            seqs[i, : len(s.ids)] = torch.tensor(s.ids)
        n = max(len(a) for a in per_seq)
        anchors = torch.full((len(batch), n), -1, dtype=torch.long)
        lens = torch.full((len(batch), n), B, dtype=torch.long)  # [b, n]
        for i, (a, ln) in enumerate(zip(per_seq, per_seq_lens, strict=True)):
            anchors[i, : len(a)] = torch.tensor(a, dtype=torch.long)
            lens[i, : len(ln)] = torch.tensor(ln, dtype=torch.long)
        lengths = torch.tensor([len(s.ids) for s in batch])
        ids, pos, labels = blocks.block_inputs(
            seqs, lengths, anchors, B, self.dcfg.mask_token_id, lens if mixed else None
        )
        seqs, anchors, ids, pos, labels, lens = (
            x.to(dev) for x in (seqs, anchors, ids, pos, labels, lens)
        )

        if self.features is None:
            feats = target_features(self.target.model, seqs, self.layers)
        else:
            feats = torch.zeros(len(batch), T, self.dcfg.feature_size)
            for i, s in enumerate(batch):
                feats[i, : len(s.ids)] = self.features.get(s.id).float()
            feats = feats.to(dev)
        make_mask = blocks.flex_block_mask if self.use_flex else blocks.dense_block_mask
        mask = make_mask(anchors, T, B, lens if mixed else None)
        with torch.no_grad():
            embeds = self.target.embed(ids)
        autocast = torch.autocast(dev.type, torch.bfloat16, enabled=self.cfg.dtype == "bf16")
        with autocast:
            ctx_pos = torch.arange(T, device=dev).expand(len(batch), T)
            hidden = self.step_model(feats.float(), ctx_pos, embeds.float(), pos, mask)
            hidden = hidden.view(len(batch), n, B, -1)[:, :, 1:]  # the anchor slot predicts
            logits = self.target.lm_head(hidden.to(self.target.dtype))  # nothing
        return block_loss_sums(logits, labels, self.weights)

    def _sync_gradients(self, sync: bool):
        """Gradients reduce over ranks only after the last micro-batch of a step."""
        if sync or self.ranks.world == 1:
            return nullcontext()
        if isinstance(self.step_model, torch.nn.parallel.DistributedDataParallel):
            return self.step_model.no_sync()
        self.step_model.set_requires_gradient_sync(False)  # FSDP
        return _resync(self.step_model)

    def _next_batch(self) -> list[Sample]:
        idx = torch.randint(len(self.samples), (self.cfg.batch_size,), generator=self.data_gen)
        return [self.samples[i] for i in idx.tolist()]

    def train_step(self) -> tuple[float, torch.Tensor]:
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        total, accs, accum, world = 0.0, [], self.cfg.grad_accum, self.ranks.world
        for micro in range(accum):
            # DDP decides at the forward whether the backward reduces: both go inside.
            with self._sync_gradients(micro == accum - 1):
                sums = self.batch_loss(self._next_batch())
                # One reduction for the whole global batch's weight, loss and hits.
                packed = torch.cat(
                    [sums.weighted_ce.detach()[None], sums.weight[None], sums.hits, sums.labelled]
                )
                packed = distributed.all_sum(packed, self.ranks)
                weight = packed[1].clamp(min=1e-9)
                # DDP and FSDP average gradients over ranks: x world gives the global batch's.
                (sums.weighted_ce * (world / (weight * accum))).backward()
            total += (packed[0] / weight).item() / accum
            k = sums.hits.numel()
            accs.append(packed[2 : 2 + k] / packed[2 + k :])
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.step += 1
        self.log["step"].append(self.step)
        self.log["loss"].append(total)
        self.log["lr"].append(self.sched.get_last_lr()[0])
        return total, torch.stack(accs).nanmean(0)

    # -- eval, checkpoint, export --------------------------------------------------------

    def _full_states(self) -> tuple[dict, dict]:
        """Unsharded model and optimizer states (collective: every rank calls it; with
        several ranks only rank 0's are filled)."""
        return distributed.full_states(self.model, self.opt)

    def evaluate(self, model_state: dict | None = None) -> AcceptanceReport:
        """Acceptance length on the eval prompts (rank 0's job)."""
        if model_state is None:
            model_state = self._full_states()[0]
        model = DFlashDrafter(self.dcfg).to(self.device)
        model.load_state_dict(model_state)
        drafter = ReferenceDrafter(model.to(self.target.dtype).eval(), self.target)
        eos = self.target.model.config.eos_token_id
        stop = [eos] if isinstance(eos, int) else list(eos or [])
        report = measure(self.target, drafter, self.eval_prompts, self.cfg.eval_max_tokens, stop)
        self.log["eval"].append(
            {
                "step": self.step,
                "tau": report.acceptance_length,
                "per_position": report.per_position,
            }
        )
        return report

    def _state(self, model_state: dict, opt_state: dict) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            "world_size": self.ranks.world,  # for the record: any number resumes it
            "step": self.step,
            "config": self.cfg.model_dump(mode="json", exclude=_BOOKKEEPING),
            "model": model_state,
            "opt": opt_state,
            "sched": self.sched.state_dict(),
            "rng": self.rng.getstate(),
            "data_gen": self.data_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "log": self.log,
        }

    def save_checkpoint(self, states: tuple[dict, dict] | None = None) -> Path:
        """Every rank calls it; rank 0 writes."""
        path = self.cfg.out / CHECKPOINT
        states = states or self._full_states()
        if self.ranks.main:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save(self._state(*states), tmp)
            tmp.replace(path)  # never leave a half-written checkpoint behind
        distributed.barrier(self.ranks)  # nobody reads it before it is whole
        return path

    def _load_checkpoint(self) -> None:
        path = self.cfg.out / CHECKPOINT
        if not path.is_file():
            raise DFlashConfigError(
                f"field 'resume' = true but {path} does not exist. Fix: drop --resume to "
                "start fresh, or point --out at the run to continue"
            )
        st = load_state(path)
        if st.get("format") != CHECKPOINT_FORMAT:
            raise DFlashConfigError(
                f"{path} was written by an older vllm-dflash (checkpoint format "
                f"{st.get('format', 1)}, this one reads {CHECKPOINT_FORMAT}). Fix: resume it "
                "with the version that wrote it, or start fresh from its export (--init-from)"
            )
        now = self.cfg.model_dump(mode="json", exclude=_BOOKKEEPING)
        changed = sorted(k for k in now if st["config"].get(k) != now[k])
        if changed:
            raise DFlashConfigError(
                f"{path} was written with different settings for {changed}; resuming would "
                "not continue the same run. Fix: use the original settings or a new out"
            )
        distributed.load_full_states(self.model, self.opt, st["model"], st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.rng.setstate(st["rng"])
        self.data_gen.set_state(st["data_gen"])
        torch.set_rng_state(st["torch_rng"])
        self.step, self.log = st["step"], st["log"]
        if self.ranks.main:
            print(f"resumed {path} at step {self.step} (written by {st['world_size']} rank(s))")

    def export(self, model_state: dict | None = None) -> Path:
        """Rank 0's job: the drafter, the log and the plot."""
        if model_state is None:
            model_state = self._full_states()[0]
        dtype = getattr(torch, self.cfg.export_dtype)
        state = {k: v.detach().to("cpu", dtype) for k, v in model_state.items()}
        out = save_drafter_checkpoint(self.cfg.out, self.dcfg, state)
        meta = {
            "decay_gamma": self.decay_gamma,
            "anchors": self.cfg.anchors,
            "config": self.cfg.model_dump(mode="json"),
            "prompt_formats": self.prompt_formats,
        }
        (self.cfg.out / LOG).write_text(json.dumps(meta | {"log": self.log}))
        plot_training(self.log, self.cfg.out / PLOT)
        return out

    # -- the loop ----------------------------------------------------------------------

    def run(self, until: int | None = None) -> Path:
        """Train to ``cfg.steps`` (or stop after step ``until`` / ``cfg.stop_after``), then
        save a checkpoint and export."""
        cfg, main = self.cfg, self.ranks.main
        end = min(cfg.steps, until or cfg.steps, cfg.stop_after or cfg.steps)
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", disable=not main)
        tau = ""
        while self.step < end:
            loss, acc = self.train_step()
            bar.update(1)
            evals = cfg.eval_every and self.step % cfg.eval_every == 0
            saves = cfg.save_every and self.step % cfg.save_every == 0
            if evals or saves:
                states = self._full_states()
                if evals and main:
                    tau = f"{self.evaluate(states[0]).acceptance_length:.2f}"
                if saves:
                    self.save_checkpoint(states)
            bar.set_postfix(loss=f"{loss:.3f}", acc1=f"{acc[0]:.2f}", tau=tau)
        bar.close()
        states = self._full_states()
        evaluated = self.log["eval"] and self.log["eval"][-1]["step"] == self.step
        if self.step >= cfg.steps and not evaluated and main:
            self.evaluate(states[0])
        self.save_checkpoint(states)
        out = self.export(states[0]) if main else self.cfg.out
        distributed.barrier(self.ranks)
        return out


@contextmanager
def _resync(model):
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def plot_training(log: dict, path: Path) -> None:
    """Loss (and its running mean) per step, and eval tau, in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps, loss = log["step"], log["loss"]
    ax.plot(steps, loss, color="tab:blue", alpha=0.3, lw=0.8)
    k = max(1, len(loss) // 50)
    smooth = [
        sum(loss[max(0, i - k + 1) : i + 1]) / len(loss[max(0, i - k + 1) : i + 1])
        for i in range(len(loss))
    ]
    ax.plot(steps, smooth, color="tab:blue", label="loss (decayed CE)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    if log["eval"]:
        ax2 = ax.twinx()
        ax2.plot(
            [e["step"] for e in log["eval"]],
            [e["tau"] for e in log["eval"]],
            "o-",
            color="tab:red",
            label="tau (held-out, greedy)",
        )
        ax2.set_ylabel("acceptance length tau", color="tab:red")
    ax.set_title("DFlash drafter training")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
