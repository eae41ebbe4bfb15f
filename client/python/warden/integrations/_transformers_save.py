"""The Trainer's own checkpoint, written in the background (issue 32).

``Trainer._save_checkpoint`` holds the step for the whole write: the model's
weights (safetensors), the optimizer's and the scheduler's state
(``torch.save``), the scaler, the RNG states and the Trainer's state, all
written to ``checkpoint-N`` on the training thread, before ``WardenCallback``
copies the directory into the tier. ``WardenTrainer`` (``async_save=True``,
the default) holds the step only while the model's, optimizer's, scheduler's
and scaler's tensors are copied into a buffer this module owns (allocated
once and reused, pinned when CUDA is there: ``async_checkpoint.copy_into``)
and the small files are written (each rank's RNG state, as the Trainer
does). Serialising, the files of ``checkpoint-N``, the copy into the tier and
the rotation of old checkpoints (``save_total_limit``) run on the
integration's background copier, one save at a time: the next save waits
for the one before (in section ``checkpoint``, counted as stall).

In: the Trainer at a save (``_save_checkpoint``). Out: ``checkpoint-N`` with
the files and formats the Trainer writes (``from_pretrained`` and
``train(resume_from_checkpoint=...)`` read it), then the tier's shard of step
N (``WardenCallback``'s format: rank 0 packs the directory, the others commit
an empty shard), then the rotation. Never: commits a checkpoint whose write
failed (its ``checkpoint-N`` is removed and the next save, or the end of
training, raises the failure); rotates an older checkpoint away before the
new one is whole; copies tied weights apart (a tensor that appears twice in
the state is snapshotted once, so ``save_pretrained`` still sees them shared).

Where the Trainer's save does more than write files on this process (DeepSpeed,
FSDP, XLA, SageMaker model parallel, PEFT adapters, a push to the Hub, a model
sharded at load time), the Trainer's own synchronous save runs instead.
Transformers internals this relies on (5.23.0): ``_save_checkpoint``'s steps
and the module names of ``transformers.trainer`` read below.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
import warnings
from typing import Any, Callable, Optional

from .. import checkpoint as _ckpt
from .. import section as _section
from ..async_checkpoint import _Slot, copy_into, drain_ready, held_s, layout, prefault, view_of, wait_ready
from ..async_shard import fill, skeleton


class TrainerSaveError(_ckpt.CheckpointError):
    """The Trainer's checkpoint could not be written in the background: it
    was not committed, and its ``checkpoint-N`` was removed."""


def _trainer_names() -> Optional[Any]:
    """``transformers.trainer``, when it has every name this module uses."""
    try:
        import transformers.trainer as t  # noqa: PLC0415
    except ImportError:  # pragma: no cover - the integration requires it
        return None
    needed = (
        "PREFIX_CHECKPOINT_DIR",
        "TRAINER_STATE_NAME",
        "TRAINING_ARGS_NAME",
        "OPTIMIZER_NAME",
        "SCHEDULER_NAME",
        "SCALER_NAME",
        "SAFE_WEIGHTS_NAME",
        "SaveStrategy",
        "ParallelMode",
        "ExportableState",
        "PreTrainedModel",
        "rotate_checkpoints",
    )
    return t if all(hasattr(t, n) for n in needed) else None


def supported(trainer: Any) -> bool:
    """Whether this Trainer's save is plain file writes on this process (see
    the module's notes); the Trainer's own save runs otherwise."""
    t = _trainer_names()
    if t is None:
        return False
    args = trainer.args
    plain = not any(
        getattr(trainer, flag, False)
        for flag in (
            "is_deepspeed_enabled",
            "is_fsdp_enabled",
            "is_fsdp_xla_enabled",
            "is_distributed_loading_by_transformers",
        )
    )
    if not plain or getattr(args, "push_to_hub", False) or getattr(trainer, "hp_search_backend", None) is not None:
        return False
    if getattr(t, "is_torch_xla_available", lambda: False)() or getattr(t, "is_sagemaker_mp_enabled", lambda: False)():
        return False
    peft = getattr(t, "PeftModel", None) if getattr(t, "is_peft_available", lambda: False)() else None
    return not (peft is not None and isinstance(trainer.model, peft))


class TrainerSaver:
    """Snapshots the Trainer's state at a save and writes ``checkpoint-N`` on
    a background copier. One per process: its buffer outlives the Trainers
    of successive in-process attempts."""

    def __init__(self) -> None:
        self._slot = _Slot()
        #: The step whose tier copy this saver took over from ``on_save``.
        self.handed: Optional[int] = None
        #: The last save's stall on the training thread, seconds (the wait
        #: for the save before it included).
        self.last_stall_s = 0.0

    def save(self, trainer: Any, trial: Any, copier: Any, save_to_tier: bool, settle: Callable) -> None:
        """The Trainer's ``_save_checkpoint``, its writes in the background.
        ``copier``: the integration's background copier; ``settle``: raises
        or warns of the failure the copier returns."""
        import torch  # noqa: PLC0415

        t = _trainer_names()
        args = trainer.args
        state = trainer.state
        step = int(state.global_step)
        started = time.perf_counter()
        with _section("checkpoint"):
            # Back pressure: the save before this one is whole (or failed) first.
            settle(copier.wait())
            if getattr(trainer, "hp_search_backend", None) is None and trial is None:
                trainer.store_flos()
            run_dir = trainer._get_output_dir(trial=trial)
            out = os.path.join(run_dir, f"{t.PREFIX_CHECKPOINT_DIR}-{step}")
            if args.should_save:
                os.makedirs(out, exist_ok=True)
            self._best_checkpoint(trainer, run_dir, t)
            if not args.save_only_model:
                trainer._save_rng_state(out)
            writer: Optional[_Writer] = None
            copy_s = 0.0
            if args.should_save:
                copy_s = self._snapshot(trainer, torch)
                for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, t.ExportableState)]:
                    name = cb.__class__.__name__
                    if isinstance(state.stateful_callbacks.get(name), list):
                        state.stateful_callbacks[name].append(cb.state())
                    else:
                        state.stateful_callbacks[name] = cb.state()
                trainer_state = copy_trainer_state(state)
                writer = _Writer(trainer, self._slot, out, run_dir, trainer_state, t)
            stall = time.perf_counter() - started
            self.last_stall_s = stall
            copier.submit(_Job(step, writer, save_to_tier, stall, copy_s).run)
            self.handed = step

    def _best_checkpoint(self, trainer: Any, run_dir: str, t: Any) -> None:
        """The Trainer's note of its best checkpoint, as ``_save_checkpoint``
        makes it (with its barrier: every rank sees the directory made)."""
        args, state = trainer.args, trainer.state
        strategies = (t.SaveStrategy.STEPS, t.SaveStrategy.EPOCH, t.SaveStrategy.BEST)
        if args.save_strategy not in strategies or not state.best_global_step:
            return
        if args.parallel_mode == t.ParallelMode.DISTRIBUTED:
            import torch.distributed as dist  # noqa: PLC0415

            dist.barrier()
        best = os.path.join(run_dir, f"{t.PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if os.path.exists(best):
            state.best_model_checkpoint = best

    def prepare(self, trainer: Any) -> None:
        """The buffer made ahead, on a thread of its own, for a save of the
        Trainer's state as it is now (``async_checkpoint.prepare``'s reasons:
        the first save after every start otherwise touches its pages on the
        training thread). Call it once the optimizer has its state."""
        import torch  # noqa: PLC0415

        tensors: list = []
        skeleton(_state(trainer), tensors, torch, shared={})
        _, need = layout(tensors)
        prefault(self._slot, need, torch.cuda.is_available(), torch)

    @property
    def grown_in_save(self) -> int:
        """Buffers a save had to allocate on the training thread."""
        return self._slot.grown

    def _snapshot(self, trainer: Any, torch: Any) -> float:
        """The model's, optimizer's, scheduler's and scaler's state copied into
        the buffer; their structure kept beside it. Returns the copy's
        seconds (for CUDA tensors, their queueing)."""
        tensors: list = []
        structure = skeleton(_state(trainer), tensors, torch, shared={})
        started = time.perf_counter()
        # CUDA tensors: queued on the training stream, waited for by the
        # writer on the copier's thread (``_Writer.run``), never here.
        try:
            copy_into(self._slot, tensors, torch.cuda.is_available(), torch, wait=False)
        except BaseException:
            # GPU copies queued before the failure finish before the buffer
            # is written again.
            drain_ready(self._slot)
            raise
        self._slot.skeleton = structure
        return time.perf_counter() - started


def copy_trainer_state(state: Any) -> Any:
    """The Trainer's ``TrainerState`` as it is now, for the background writer:
    deep-copied but for ``log_history``, whose list is copied and whose
    entries are shared. The log grows by an entry per logging step (10,000
    after 100,000 steps logged every 10), and a deep copy of it held the
    step 140 ms a save at that size, growing with the run; the Trainer
    only ever appends to it an entry made for it (``Trainer.log``: its
    callbacks get another dict), so an entry, once in, does not change."""
    history = getattr(state, "log_history", None)
    if not isinstance(history, list):
        return copy.deepcopy(state)
    state.log_history = []
    try:
        copied = copy.deepcopy(state)
    finally:
        state.log_history = history
    copied.log_history = list(history)
    return copied


def _state(trainer: Any) -> dict:
    """What a save snapshots: the model's, optimizer's, scheduler's and
    scaler's state dictionaries (the model's alone with ``save_only_model``)."""
    full: dict = {"model": trainer.model.state_dict()}
    if not trainer.args.save_only_model:
        full["optimizer"] = trainer.optimizer.state_dict()
        full["scheduler"] = trainer.lr_scheduler.state_dict()
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        if scaler is not None:
            full["scaler"] = scaler.state_dict()
    return full


class _Writer:
    """``checkpoint-N``'s files from the snapshot, as the Trainer writes them."""

    def __init__(self, trainer: Any, slot: _Slot, out: str, run_dir: str, trainer_state: Any, t: Any) -> None:
        self.trainer = trainer
        self.slot = slot
        self.out = out
        self.run_dir = run_dir
        self.trainer_state = trainer_state
        self.t = t

    def run(self) -> None:
        import torch  # noqa: PLC0415

        t, tr, out = self.t, self.trainer, self.out
        # Each tensor its own copy: views into one buffer would make
        # save_pretrained see every weight as shared, and torch.save write
        # the whole buffer with each.
        tensors = [view_of(self.slot, m, torch).clone() for m in self.slot.metas]
        full = fill(self.slot.skeleton, tensors)
        os.makedirs(out, exist_ok=True)
        model = tr.accelerator.unwrap_model(tr.model, keep_torch_compile=False)
        if isinstance(model, t.PreTrainedModel):
            model.save_pretrained(out, state_dict=full["model"], is_main_process=True)
        else:
            import safetensors.torch  # noqa: PLC0415

            safetensors.torch.save_file(full["model"], os.path.join(out, t.SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        if tr.processing_class is not None:
            tr.processing_class.save_pretrained(out)
        elif getattr(getattr(tr, "data_collator", None), "tokenizer", None) is not None:
            tr.data_collator.tokenizer.save_pretrained(out)
        torch.save(tr.args, os.path.join(out, t.TRAINING_ARGS_NAME))
        if "optimizer" in full:
            torch.save(full["optimizer"], os.path.join(out, t.OPTIMIZER_NAME))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.save(full["scheduler"], os.path.join(out, t.SCHEDULER_NAME))
        if "scaler" in full:
            torch.save(full["scaler"], os.path.join(out, t.SCALER_NAME))
        # The Trainer's state last: a directory with it is a whole one.
        self.trainer_state.save_to_json(os.path.join(out, t.TRAINER_STATE_NAME))
        self.slot.skeleton = None

    def rotate(self) -> None:
        self.t.rotate_checkpoints(
            output_dir=self.run_dir,
            save_total_limit=self.trainer.args.save_total_limit,
            best_model_checkpoint=self.trainer_state.best_model_checkpoint,
            use_mtime=True,
        )


class _Job:
    """One save on the copier's thread: the files (rank 0), the tier's shard,
    then the rotation."""

    def __init__(self, step: int, writer: Optional[_Writer], tier: bool, stall: float, copy_s: float) -> None:
        self.step = step
        self.writer = writer
        self.tier = tier
        self.stall = stall
        self.copy_s = copy_s

    def run(self) -> None:
        from ._tar import pack, tar_size  # noqa: PLC0415

        src = self.writer.out if self.writer is not None else None
        if self.writer is not None:
            try:
                # The GPU's copies first, so the stall booked holds them.
                self.stall = held_s(self.stall, self.copy_s, wait_ready(self.writer.slot))
                self.writer.run()
            except BaseException as e:
                shutil.rmtree(self.writer.out, ignore_errors=True)
                raise TrainerSaveError(
                    f"the Trainer's checkpoint of step {self.step} was not written ({src}): {e}"
                ) from e
        if self.tier:
            _ckpt.save_file(
                self.step,
                lambda p: pack(src, p, "the Trainer's checkpoint"),
                size_hint=tar_size(src),
                stall=self.stall,
            )
        if self.writer is not None:
            self.writer.rotate()
