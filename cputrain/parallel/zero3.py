"""DeepSpeed ZeRO-3: parameters, gradients and optimizer state partitioned across ranks,
optionally offloaded to host memory (DeepSpeed's CPU Adam steps the optimizer there).

The only module that imports deepspeed. It runs on DeepSpeed's CPU accelerator on top of the
process group cputrain already made (gloo, or ccl where its bindings import); under plain
`python` with one rank it makes a one-rank group itself, which is where DeepSpeed alone would
stop with KeyError: 'LOCAL_RANK'.

Build order as for every strategy: wrap() builds the model under deepspeed.zero.Init, so each
parameter is partitioned the moment its module is constructed and no rank ever holds the whole
model; load_weights() fills each rank's partitions; build_optimizer() hands model and optimizer
to deepspeed.initialize.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from cputrain.parallel.deepspeed_config import plan_for, require_deepspeed

require_deepspeed()  # a one-line install hint instead of an ImportError traceback
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read once, when deepspeed picks its accelerator
# DeepSpeed's CPU ops (CPU Adam, shared-memory collectives) compile into torch's extensions folder,
# by default one per user keyed by the op's name only: two environments on one machine (two
# checkouts, a torch upgrade) rebuild each other's ops in turn, 40–235 s each (measured). One folder
# per Python environment, where scripts/install.sh builds them, unless the user chose one.
if os.access(sys.prefix, os.W_OK):
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from cputrain.errors import ConfigError  # noqa: E402
from cputrain.model import SafetensorsReader, decoder_blocks, enable_activation_checkpointing, load_into  # noqa: E402
from cputrain.parallel.adamw import adamw, decay_groups  # noqa: E402
from cputrain.native.allocator import pin_mmap_threshold  # noqa: E402
from cputrain.parallel.base import Strategy, StrategyContext, all_finite  # noqa: E402
from cputrain.config.resolve import grad_accum_steps  # noqa: E402

log = logging.getLogger("cputrain")
# DeepSpeed still calls collectives torch has renamed; one warning per call would flood the log.
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated.*")
TAG = "zero3"  # DeepSpeed's checkpoint tag: the sub-folder of a step's state/


class Zero3Model(nn.Module):
    """What the trainer calls forward on: the DeepSpeed engine once it exists, else the module.

    The engine is kept out of the module tree (it wraps the same parameters), so parameters(),
    train() and eval() see each parameter once.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.__dict__["engine"] = None

    def forward(self, *args, **kwargs):
        return (self.engine or self.module)(*args, **kwargs)

    @property
    def config(self):
        return self.module.config


class Zero3Strategy(Strategy):
    name = "zero3"
    supports_offload = True

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        # DeepSpeed gathers and frees whole modules every step: keep glibc from holding on to them.
        pin_mmap_threshold()
        # DeepSpeed's CPU accelerator counts its "devices" on every gradient bucket it reduces (to
        # find the nodes for ZeRO++'s quantized all-to-all, which cputrain does not use) by running
        # `numactl --hardware` unless LOCAL_SIZE is set: 0.95 ms a call where numactl is installed
        # (the training image has it), 0.4 ms of a failed spawn where not, on a 2-core EPYC. The
        # count it wants is the ranks on this node.
        os.environ.setdefault("LOCAL_SIZE", str(ctx.ranks_per_node))
        cfg = ctx.cfg
        self.plan = plan_for(cfg, ctx.world_size, grad_accum_steps(cfg, ctx.world_size))
        self.engine = None
        self._hidden_size = None
        for logger in ("DeepSpeed", "deepspeed"):  # its per-step chatter is not cputrain's log
            logging.getLogger(logger).setLevel(logging.WARNING)

    # --- build ---------------------------------------------------------------------------
    def _ensure_process_group(self) -> None:
        if not dist.is_initialized():
            # One rank (plain `python`): an in-process store, so no port is taken or needed.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False,
                                   dist_init_required=False)

    def wrap(self, skeleton: nn.Module) -> nn.Module:
        from transformers import AutoModelForCausalLM
        from transformers import initialization as hf_init
        from transformers.integrations.deepspeed import prevent_arange_dtype_change

        self._ensure_process_group()
        self._plug_reduce_scatter()
        hf_config = skeleton.config
        # Bucket sizes follow the hidden size; the plan is final (and reported) before any weight.
        self.plan = plan_for(self.ctx.cfg, self.ctx.world_size, grad_accum_steps(self.ctx.cfg, self.ctx.world_size),
                             getattr(hf_config, "hidden_size", None))
        if self.ctx.rank == 0:
            for note in self.plan.notes:
                log.warning("warning: %s", note)
            log.info("zero3: DeepSpeed %s, %s backend, optimizer offload %s, parameter offload %s",
                     deepspeed.__version__, dist.get_backend(), "on" if self.plan.offload_optimizer else "off",
                     "on" if self.plan.offload_param else "off")
        # The meta skeleton is not used: zero.Init partitions every parameter as its module is
        # constructed. Weight init is off here; load_weights fills the partitions.
        # No dtype= here: zero.Init takes it from the config's bf16 section. An explicit dtype is
        # overridden with bf16 on a CPU accelerator (an operator-precedence slip in
        # Init._set_dtype), which would silently round fp32 weights.
        with hf_init.no_init_weights(), prevent_arange_dtype_change(), deepspeed.zero.Init(
            config_dict_or_path=self.plan.config
        ):
            module = AutoModelForCausalLM.from_config(
                hf_config,
                attn_implementation=self.ctx.cfg.model.attn_implementation,
                trust_remote_code=self.ctx.cfg.model.trust_remote_code,
                dtype=self.ctx.compute_dtype,
            )
        enable_activation_checkpointing(module, self.ctx.cfg.model.activation_checkpointing)
        self._fetch_blocks_whole(module)
        return Zero3Model(module)

    def _fetch_blocks_whole(self, module: nn.Module) -> None:
        """Each decoder block a DeepSpeed leaf module: its parameters fetched and released together,
        one hook pair per block instead of one per linear and norm. DeepSpeed's hooks run in Python
        per module per micro-batch: at ~100M in bf16 they were 1.70 s of a 10.40 s step on one rank.
        Fetched whole, one rank's step went from 1.18× the single strategy's to 1.03× there, and
        2 ranks from 0.84× DDP's tokens/s to 0.89× (block zero3_fetch of docs/benchmarks/network.md;
        DeepSpeed's other knobs measured there moved it by no more than the noise). A block is what the memory plan
        already counts as zero3's gathered unit. A DeepSpeed file that names its own leaf modules
        (or a granularity threshold) keeps them."""
        if self.plan.fetch_granularity_set:
            return
        block_types = list(dict.fromkeys(type(block) for block in decoder_blocks(module)))
        deepspeed.utils.set_z3_leaf_modules(module, block_types)
        if self.ctx.rank == 0:
            log.info("zero3: each %s fetched whole (a DeepSpeed leaf module): one hook pair per block",
                     ", ".join(t.__name__ for t in block_types))

    def load_weights(self, model: Zero3Model, folder: Path | None) -> None:
        module = model.module
        if folder is None:
            # transformers' own ZeRO-3 init: each module's parameters are gathered, initialised
            # on rank 0 in the same order and from the same seed as a single-process run, and
            # scattered back; only one module's parameters are ever whole at a time.
            from transformers.integrations.deepspeed import initialize_weights_zero3

            torch.manual_seed(self.ctx.cfg.seed)
            for sub in module.modules():
                sub._is_hf_initialized = False
            initialize_weights_zero3(module)
            module.tie_weights()
        else:
            # Each rank reads from the safetensors files only the rows that cover its partition.
            load_into(module, folder, copy_fn=self._copy_partition, shape_of=lambda param: list(param.ds_shape),
                      file_name_of=self.ctx.file_name_of)
        self._gather_head_for_chunked_loss(module)

    def _gather_head_for_chunked_loss(self, module: nn.Module) -> None:
        """model.chunked_loss uses the head's weight without calling the head
        (cputrain.kernels.chunked_head), and ZeRO-3 gathers a partitioned parameter only around
        its own module's forward: the model's forward gathers it instead."""
        if self.ctx.cfg.model.chunked_loss:
            deepspeed.zero.register_external_parameter(module, module.get_output_embeddings().weight)

    def _copy_partition(self, name: str, param: nn.Parameter, reader: SafetensorsReader, key: str) -> None:
        shape = list(param.ds_shape)
        part = param.ds_tensor
        start = self.ctx.rank * part.numel()  # partitions are equal slices of the flat tensor
        count = min(part.numel(), max(0, param.ds_numel - start))
        if count == 0:
            return  # this rank holds only padding of a small parameter
        row = param.ds_numel // shape[0] if shape else 1
        first, last = start // row, math.ceil((start + count) / row)
        rows = reader.read(key, slice(first, last)) if shape else reader.read(key)
        flat = rows.reshape(-1)[start - first * row : start - first * row + count]
        part.data[:count].copy_(flat.to(part.dtype))

    def build_optimizer(self, model: Zero3Model) -> torch.optim.Optimizer:
        t = self.ctx.cfg.train
        # ds_shape: a partitioned parameter's own shape is empty.
        groups = decay_groups(model.module.parameters(), t.weight_decay, ndim=lambda p: len(p.ds_shape))
        if self.plan.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(groups, lr=t.lr, betas=(t.beta1, t.beta2), adamw_mode=True)
        else:
            optimizer = adamw(groups, t)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model.module, optimizer=optimizer, config=self.plan.config, dist_init_required=False
        )
        model.__dict__["engine"] = self.engine
        # The trainer's LR schedule sets lr on these param_groups; DeepSpeed steps this optimizer
        # over its fp32 partitions with exactly those groups.
        return optimizer

    # --- step ----------------------------------------------------------------------------
    def autocast(self):
        # DeepSpeed holds bf16 parameters itself when bf16 is on; autocast on top would only re-cast.
        return contextlib.nullcontext()

    def accumulation(self, model: nn.Module, last_micro_batch: bool):
        # The trainer runs the accumulation loop and calls step() once: tell the engine which
        # backward ends it, so gradients are reduced and the optimizer steps only then.
        self.engine.set_gradient_accumulation_boundary(last_micro_batch)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the trainer already divided by the micro-batches

    # DeepSpeed computes the norm inside engine.step(), after which the step is taken: a
    # non-finite step cannot be skipped here, only detected (the trainer then stops at once).
    can_skip_step = False
    cannot_skip_words = "zero3 cannot skip it"

    def step(self, model: nn.Module, optimizer, grad_clip: float, loss_finite: bool = True) -> tuple[float, bool]:
        self.engine.step()  # clips to gradient_clipping, steps, zeroes the gradient partitions
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return norm, loss_finite and math.isfinite(norm)

    # --- state ---------------------------------------------------------------------------
    def checkpoint_state(self, model: nn.Module, optimizer) -> DeepSpeedState:
        return DeepSpeedState(self.engine)

    def weights_finite(self, model: Zero3Model) -> bool:
        """This rank's partitions (ds_tensor) of the trained parameters: module.parameters() are
        empty placeholders between forwards."""
        return all_finite([p.ds_tensor for p in model.module.parameters()
                           if p.requires_grad and getattr(p, "ds_tensor", None) is not None])

    def tensors_held(self, model: Zero3Model) -> tuple[list, list, list]:
        """(parameter, gradient, master) tensors this rank holds, where DeepSpeed keeps them:
        partitions (ds_tensor), gradient partitions and fp32 master partitions all live outside
        module.parameters().

        Gradients are the partitions that persist through backward (grad_partitions_flat_buffer;
        with optimizer offload, the fp32 gradient buffers on the host). DeepSpeed also makes a
        flattened copy of one parameter group's gradients for the length of its optimizer step;
        that transient copy shows in the step's peak RSS, not here.
        """
        params = list({id(p): p for p in model.module.parameters()}.values())
        param_tensors = [getattr(p, "ds_tensor", None) for p in params] + [p.data for p in params]
        zero = self.engine.optimizer if self.engine is not None else None
        if zero is None:
            return param_tensors, [], []
        masters = list(getattr(zero, "fp32_partitioned_groups_flat", []))
        flat = getattr(zero, "grad_partitions_flat_buffer", None)
        grads = [flat] if flat is not None else [m.grad for m in masters]
        return param_tensors, grads, masters

    def full_state_dict(self, model: Zero3Model, keep: Callable[[str], bool] = lambda name: True
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """One parameter gathered at a time (a collective: every rank iterates), returned as fp32."""
        module = model.module
        for name, param in module.named_parameters():
            if not keep(name):
                continue
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                full = param.data.detach().to(torch.float32, copy=True)
            yield name, full
        params = {n for n, _ in module.named_parameters()}
        for name, tensor in module.state_dict().items():
            if name not in params and keep(name) and not (getattr(module.config, "tie_word_embeddings", False)
                                           and name.endswith("lm_head.weight")):
                yield name, tensor  # persistent buffers are never partitioned

    def unwrap(self, model: Zero3Model) -> nn.Module:
        return model.module

    def _plug_reduce_scatter(self) -> None:
        """ZeRO-3 reduce-scatters each bucket of gradients through one module-level function of
        DeepSpeed's (coalesced_collectives._torch_reduce_scatter_fn: the gradients pre-divided,
        then summed): on gloo (parallel.reduce_scatter) the all-to-all one takes its place, for
        half the bytes of gloo's own."""
        parallel = self.ctx.cfg.parallel
        if not (parallel.reduce_scatter == "all_to_all" or (
                parallel.reduce_scatter == "auto" and dist.get_backend() == "gloo")):
            return
        from deepspeed.runtime.comm import coalesced_collectives

        from cputrain.parallel.reduce_scatter import AllToAllReduceScatter

        reduce_scatter = AllToAllReduceScatter()

        def all_to_all_fn(input_tensor, output_tensor, group=None, async_op=False, prof=False):
            reduce_scatter(output_tensor, input_tensor, group or dist.group.WORLD, dist.ReduceOp.SUM)

        self._deepspeed_reduce_scatter = coalesced_collectives._torch_reduce_scatter_fn
        coalesced_collectives._torch_reduce_scatter_fn = all_to_all_fn

    def close(self) -> None:
        super().close()
        self.engine = None
        release_shared_memory_segment(self.ctx.rank)
        original = getattr(self, "_deepspeed_reduce_scatter", None)
        if original is not None:
            from deepspeed.runtime.comm import coalesced_collectives

            coalesced_collectives._torch_reduce_scatter_fn = original


def release_shared_memory_segment(rank: int) -> None:
    """DeepSpeed's CPU backend creates, where every rank is on one node, a shared-memory segment per
    rank for its all-reduce (ops/csrc/cpu/comm/shm.cpp: /dev/shm/deepspeed_allreduce_buffer_<uid>_
    <MASTER_ADDR>_<MASTER_PORT>_<rank>, 66 MB) and never unlinks it: /dev/shm is memory, and every
    run left 66 MB a rank there until the machine restarted (a host that ran a few hundred zero3
    runs held 18 GiB, and the kernel's OOM killer took a rank). At the end of the run each rank
    unlinks its own; a peer still mapping it keeps its pages until it exits."""
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    with contextlib.suppress(FileNotFoundError, PermissionError):
        (Path("/dev/shm") / name).unlink()


class DeepSpeedState:
    """The engine's own checkpoint (DeepSpeed's layout under the step's state/): every rank
    writes its own partitions, model states on rank 0, optimizer states per rank."""

    def __init__(self, engine):
        self.engine = engine

    @staticmethod
    def _local(path: str) -> str:
        if "://" in path and not path.startswith("file://"):
            raise ConfigError(f"strategy zero3 saves checkpoints through DeepSpeed, which needs a local output_dir, "
                              f"not '{path}'")
        return path.removeprefix("file://")

    def save(self, path: str) -> None:
        self.engine.save_checkpoint(self._local(path), tag=TAG, save_latest=False)

    def load(self, path: str) -> None:
        loaded, _ = self.engine.load_checkpoint(self._local(path), tag=TAG, load_optimizer_states=True,
                                                load_lr_scheduler_states=False)
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{TAG}' under {path}")


def build(ctx: StrategyContext) -> Strategy:
    return Zero3Strategy(ctx)
