"""One rank's training setup for a trial spec, reusable in-process (`Training.from_spec(spec)`,
then `.step()`): the trial runner measures it, the build step compiles and times it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from tuner.config import Config, infeasible_reasons, microbatches
from tuner.devices import DeviceInfo, describe, torch_device
from tuner.recipe import Recipe, recipe_from_dict
from tuner.result import TrialSpec
from tuner.workload.apply import apply_all
from tuner.workload.data import make_loader
from tuner.workload.model import Decoder, build_meta, materialize
from tuner.workload.parallel import ParallelDims, RankEnv, init_distributed
from tuner.workload.precision import MasterWeights, low_dtype, make_optimizer, make_scaler


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _build_sharded(
    recipe: Recipe, config: Config, dims: ParallelDims, pp_rank: int, device: torch.device, seed: int
):
    """(the whole model, this rank's module, whether FSDP shards it): built on the meta device
    until apply_all has split it, so the rank allocates (and initialises) only its shard."""
    model = build_meta(recipe.model, config.attention)
    low = low_dtype(config)
    fsdp = dims.dp_enabled and config.dp_shard == "fsdp"
    if config.amp == "O1":
        model.autocast = (device.type, low)
    elif config.amp == "O2" and not fsdp:
        model.to(low)  # still meta: the weights are allocated (and drawn) in `low`
    fsdp_dtype = low if config.amp == "O2" else None

    def allocate(module: nn.Module) -> None:
        materialize(module, recipe.model, device, seed)

    module = apply_all(model, config, dims, pp_rank, device, allocate, fsdp_param_dtype=fsdp_dtype)
    return model, module, fsdp


def _check_feasible(config: Config, recipe: Recipe, info: DeviceInfo, world: int) -> None:
    """The study prunes infeasible configs before launch; a spec run directly gets the same
    verdict here rather than, say, a pipeline that silently drops the layers pp does not divide.
    Rank and device counts are the launcher's business, so they are taken as launched."""
    launched = recipe.model_copy(update={"hardware": recipe.hardware.model_copy(update={"devices": world})})
    reasons = infeasible_reasons(config, launched, dataclasses.replace(info, count=max(info.count, world)))
    if reasons:
        raise ValueError("config cannot run here: " + "; ".join(reasons))


@dataclass
class Training:
    """Model, optimizer, data and schedule of one rank. `module` is what runs forward (the
    stage module under pp, wrapped by DDP/FSDP under dp); `model` is the family's model inside it."""

    spec: TrialSpec
    recipe: Recipe
    config: Config
    env: RankEnv
    dims: ParallelDims
    device: torch.device
    model: Decoder
    module: nn.Module
    optimizer: torch.optim.Optimizer
    master: MasterWeights | None
    scaler: torch.amp.GradScaler | None
    n_microbatches: int
    batches: Any
    # The rank's parameters as the optimizer holds them, listed before any forward: DDP over a
    # tensor-parallel model swaps DTensor attributes in and out of the module around each forward,
    # so `module.parameters()` is not a stable account of them.
    params: list[torch.Tensor] = field(default_factory=list)
    schedule: Any = None
    _pp_losses: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def from_spec(cls, spec: TrialSpec, env: RankEnv | None = None) -> Training:
        """Build everything for this rank. Joins the process group when world size > 1 (from the
        torchrun-style environment unless `env` is given)."""
        recipe = recipe_from_dict(spec.recipe, "spec.recipe")
        config = Config.from_params(spec.config)
        env = env or RankEnv.from_environ()
        info = describe(spec.family)
        dims = ParallelDims(config.dp, config.tp, config.pp, env.world_size)
        _check_feasible(config, recipe, info, env.world_size)
        init_distributed(info.backend, env, spec.timeout_s)
        device = torch_device(spec.family, env.local_rank)
        if env.world_size > 1:
            dims.build_mesh(device.type)
        coords = dims.coords(env.rank)
        torch.backends.cuda.matmul.allow_tf32 = config.tf32
        torch.backends.cudnn.allow_tf32 = config.tf32

        model, module, fsdp = _build_sharded(recipe, config, dims, coords["pp"], device, spec.seed)
        train = recipe.train
        params = [p for p in module.parameters() if p.requires_grad]

        def make(ps: list) -> torch.optim.Optimizer:
            return make_optimizer(ps, train.optimizer, train.lr, config.optimizer_impl)

        master = MasterWeights(params, make) if config.amp == "O2" and not fsdp else None
        optimizer = master.optimizer if master else make(params)
        n_micro = microbatches(config, recipe)
        loader = make_loader(
            recipe.model.vocab,
            recipe.model.seq_len,
            spec.seed,
            train.global_batch_size,
            config.micro_batch_size,
            config.dp,
            coords["dp"],
            config.loader_workers,
            config.pin_memory,
        )
        training = cls(
            spec, recipe, config, env, dims, device, model, module, optimizer, master,
            make_scaler(config, device.type), n_micro, iter(loader), params,
        )  # fmt: skip
        if dims.pp_enabled:
            training.schedule = training._make_schedule(coords["pp"])
        if training.scaler:
            # Only the last stage scales a loss; this starts every rank at the same scale.
            training.scaler.scale(torch.ones((), device=device))
        return training

    def _make_schedule(self, pp_rank: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if hasattr(self.module, "reducer"):
            # DDP under a pipeline: the stage arms the gradient all-reduce itself before the last
            # microbatch's backward. Left on, DDP's forward would arm it on every microbatch, and
            # its bucket rebuild then sees each parameter once per backward and fails.
            self.module.require_backward_grad_sync = False
        stage = PipelineStage(
            self.module, pp_rank, self.dims.pp, self.device, group=self.dims.mesh["pp"].get_group()
        )
        cls = Schedule1F1B if self.config.pp_schedule == "1f1b" else ScheduleGPipe
        # scale_grads divides by n_microbatches, so loss_fn returns the per-microbatch mean.
        return cls(stage, n_microbatches=self.n_microbatches, loss_fn=self._pp_loss, scale_grads=True)

    @property
    def is_last_stage(self) -> bool:
        return self.dims.coords(self.env.rank)["pp"] == self.dims.pp - 1

    @property
    def is_first_stage(self) -> bool:
        return self.dims.coords(self.env.rank)["pp"] == 0

    def _next_microbatch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(self.batches)
        nb = self.config.pin_memory
        return x.to(self.device, non_blocking=nb), y.to(self.device, non_blocking=nb)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The model knows whether its logits are whole or sharded over the vocabulary (tp > 1).
        return self.model.loss(logits, targets)

    def _pp_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self._loss(logits, targets)
        self._pp_losses.append(loss.detach())
        return self.scaler.scale(loss) if self.scaler else loss

    def _grad_sync(self, enabled: bool):
        """Skip the gradient all-reduce on all but the last microbatch of a step."""
        if hasattr(self.module, "no_sync"):  # DDP
            return contextlib.nullcontext() if enabled else self.module.no_sync()
        if hasattr(self.module, "set_requires_gradient_sync"):  # FSDP2
            self.module.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def _forward_backward(self) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for i in range(self.n_microbatches):
            x, y = self._next_microbatch()
            with self._grad_sync(i == self.n_microbatches - 1):
                loss = self._loss(self.module(x), y)
                scaled = loss / self.n_microbatches
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += loss.detach()
        return total / self.n_microbatches

    def _pipeline_forward_backward(self) -> torch.Tensor:
        # Only the first stage needs inputs and only the last needs targets.
        xs, ys = [], []
        if self.is_first_stage or self.is_last_stage:
            for _ in range(self.n_microbatches):
                x, y = self._next_microbatch()
                xs.append(x)
                ys.append(y)
        self._pp_losses.clear()
        kwargs = {"target": torch.cat(ys)} if self.is_last_stage else {}
        args = (torch.cat(xs),) if self.is_first_stage else ()
        self.schedule.step(*args, return_outputs=False, **kwargs)
        if not self.is_last_stage:
            return torch.zeros((), device=self.device)
        return torch.stack(self._pp_losses).mean()

    def _optimizer_step(self) -> None:
        with record_function("optimizer"):
            if self.master:
                self.master.grads_to_master()
            if self.scaler:
                self._scaled_step()
            else:
                self.optimizer.step()
            if self.master:
                self.master.master_to_params()

    def _scaled_step(self) -> None:
        """fp16 loss scaling across ranks: every rank must skip the same steps, or the replicas'
        weights diverge. Pipeline stages and tensor-parallel shards each see only their own
        gradients, so the inf/nan verdict is agreed by an all-reduce (as FSDP's sharded scaler
        does) before the step."""
        self.scaler.unscale_(self.optimizer)
        if self.env.world_size > 1:
            state = self.scaler._per_optimizer_states[id(self.optimizer)]
            for found_inf in state["found_inf_per_device"].values():
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def zero_grad(self) -> None:
        if self.master:
            self.master.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> torch.Tensor:
        """One optimizer step over the global batch. Returns this rank's mean loss as a tensor
        (no device sync; 0 on ranks that hold no loss: pipeline stages other than the last).
        `global_losses` turns a list of them into the global-batch loss per step."""
        self.zero_grad()
        if self.schedule is not None:
            loss = self._pipeline_forward_backward()
        else:
            loss = self._forward_backward()
        self._optimizer_step()
        return loss

    def global_losses(self, local: list[torch.Tensor]) -> list[float]:
        """Mean loss over the global batch for each step, identical on every rank."""
        if self.env.world_size == 1:
            return [float(v) for v in local]
        coords = self.dims.coords(self.env.rank)
        holds = self.is_last_stage and coords["tp"] == 0
        # Each dp replica's last stage holds the loss of its slice of the batch; average them.
        vals = torch.stack(local).float() / self.dims.dp if holds else torch.zeros(len(local))
        vals = vals.to(self.device)
        dist.all_reduce(vals)
        return vals.tolist()

    def local_params(self) -> int:
        return sum(_local_numel(p) for p in self.params)

    def rank_report(self) -> dict[str, Any]:
        """What this rank actually runs, for the trial's evidence (result.extra["ranks"])."""
        param = self.params[0]
        return {
            "rank": self.env.rank,
            "coords": self.dims.coords(self.env.rank),
            "params": self.local_params(),
            "layers": sorted(int(k) for k in self.model.layers),
            "param_dtype": str(param.dtype).replace("torch.", ""),
            "master_dtype": "float32" if self.master else None,
            "bucket_cap_bytes": getattr(self.module, "bucket_bytes_cap", None),
            "fsdp": hasattr(self.module, "set_requires_gradient_sync"),
            "n_microbatches": self.n_microbatches,
            "threads": torch.get_num_threads(),
            "cpus": sorted(os.sched_getaffinity(0)),
        }
