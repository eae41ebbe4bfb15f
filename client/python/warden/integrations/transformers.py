"""Hugging Face Transformers: steps, sections and checkpoints through the local warden agent.

    import warden
    from warden.integrations.transformers import WardenCallback, restore_dir

    def train():
        args = TrainingArguments(output_dir="out", save_strategy="steps", save_steps=500, ...)
        trainer = Trainer(model=make_model(), args=args, train_dataset=ds,
                          callbacks=[WardenCallback()])
        trainer.train(resume_from_checkpoint=restore_dir(args.output_dir))   # None: fresh

    warden.run(train)     # in-process restarts: train() again, resuming from the tier

In: the Trainer's callback events and the model's forward. Out: one warden
step per optimizer step (``state.global_step``; the micro-batches of
gradient accumulation inside it), the sections ``forward`` (the model's
forward, timed by a forward pre-hook and hook on the model), ``backward``
(from the end of the forward through the loss's backward and gradient
clipping) and ``optimizer``, and after each checkpoint the Trainer saves
(``on_save``: its ``checkpoint-N`` directory) a copy in the agent's tier as
the rank's shard of step N, in section ``checkpoint``. Never: fails training
because the agent is away (a failed copy is a warning, the next save tries
again), or leaves a section open after an exception.

The directory is packed (tar, uncompressed) by the process that saves it
(``args.should_save``: world process zero); the other ranks commit an empty
shard so that the step is complete, and every rank restores rank 0's
(``restore_dir``), unpacked into a directory of its own.

The copy is asynchronous (``async_copy=True``, the default): ``on_save``
holds the step only while the checkpoint's files are hard-linked into a
snapshot beside it (``<output_dir>/.warden-snapshots``; copied where links
cannot be made), since the Trainer writes each file once and may delete
the directory later (``save_total_limit``); packing into the tier and the
commit run on a background thread. One copy is in flight at a time: the
next ``on_save`` waits for it (in section ``checkpoint``). A copy that
fails in the background is never committed; the next ``on_save`` (or the
end of training) warns of it. ``restore_dir`` first waits for this
process's copy in flight, so an in-process restart resumes from it.

``WardenTrainer`` also writes the Trainer's own checkpoint in the background
(``async_save=True``, the default; ``_transformers_save`` holds how): the step
is held only while the tensors are copied into a reused buffer, and
``checkpoint-N``, its copy into the tier and the rotation run on the same
background thread as the copies above.

``WardenTrainingArguments`` and ``WardenTrainer`` heal a DDP job from a live
replica instead (``warden.heal``; ``_transformers_heal`` holds how): each
attempt's process group is warden's, and at every ``train`` the ranks behind
receive model, optimizer, LR scheduler and the Trainer's progress from a
live rank, the tier being the fall-back where none lives.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Optional

from . import require
from ._steps import StepTracker
from ._tar import pack, tar_size, unpack
from .. import checkpoint as _ckpt
from .._notice import Preempted as _Preempted
from .._notice import notice as _notice
from .. import section as _section
from ._transformers_heal import HEAL as _HEAL
from ._transformers_heal import LIVE as _LIVE
from ._transformers_heal import _debug
from ._transformers_save import TrainerSaveError, TrainerSaver
from ._transformers_save import supported as _async_supported

_tf = require("transformers", "warden.integrations.transformers", "transformers accelerate")

__all__ = ["TrainerSaveError", "WardenCallback", "WardenTrainer", "WardenTrainingArguments", "restore_dir"]

#: The Trainer's name for a checkpoint directory: checkpoint-<global step>.
PREFIX = "checkpoint"


class _TierCopier:
    """The background copy of checkpoint snapshots into the tier: one at a
    time, its failure kept for the next caller to say."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def wait(self) -> Optional[BaseException]:
        """Waits for the copy in flight; returns (and forgets) the last failure."""
        t = self._thread
        if t is not None:
            t.join()
        with self._lock:
            self._thread = None
            e, self._error = self._error, None
        return e

    def start(self, step: int, snapshot: Optional[str], size_hint: int, stall: float) -> None:
        """Copies ``snapshot`` (None: an empty shard) into the tier as step
        ``step``, then removes it."""

        def copy() -> None:
            try:
                _ckpt.save_file(step, lambda p: _pack(snapshot, p), size_hint=size_hint, stall=stall)
            finally:
                if snapshot is not None:
                    shutil.rmtree(os.path.dirname(snapshot), ignore_errors=True)

        self.submit(copy)

    def submit(self, task: Callable[[], None]) -> None:
        """Runs ``task`` on a thread of its own; call ``wait`` first."""
        t = threading.Thread(target=self._run, args=(task,), name="warden-tier-copy", daemon=True)
        with self._lock:
            self._thread = t
        t.start()

    def _run(self, task: Callable[[], None]) -> None:
        try:
            task()
        except BaseException as e:  # noqa: BLE001 - said by the next caller
            with self._lock:
                self._error = e


#: The process's background copier (shared by the callbacks of successive
#: in-process attempts).
_copier = _TierCopier()
#: ``WardenTrainer``'s async save of the Trainer's own checkpoint (its buffer
#: kept across attempts).
_saver = TrainerSaver()


def _snapshot(src: str, output_dir: str, step: int) -> str:
    """``src`` (checkpoint-N) hard-linked, file by file, into a fresh folder
    under ``<output_dir>/.warden-snapshots``; copied where a link cannot be
    made (another filesystem). Returns the snapshot's checkpoint-N."""
    if not os.path.isdir(src):
        raise _ckpt.CheckpointError(f"the Trainer's checkpoint {src} is not a directory")
    base = os.path.join(output_dir, ".warden-snapshots")
    os.makedirs(base, mode=0o700, exist_ok=True)
    import tempfile  # noqa: PLC0415

    holder = tempfile.mkdtemp(prefix=f"step-{step}-", dir=base)
    dst = os.path.join(holder, os.path.basename(src))

    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    try:
        shutil.copytree(src, dst, copy_function=link_or_copy)
    except BaseException:
        shutil.rmtree(holder, ignore_errors=True)
        raise
    return dst


def _say_failure(e: Optional[BaseException]) -> None:
    if e is not None:
        warnings.warn(f"warden: a checkpoint copy to the tier failed in the background: {e}", stacklevel=3)


def _settle(e: Optional[BaseException]) -> None:
    """A background failure said: the Trainer's own checkpoint not written
    (``WardenTrainer``'s async save) is raised, as the Trainer's own save
    would have raised it; a copy into the tier that failed is a warning."""
    if isinstance(e, TrainerSaveError):
        raise e
    _say_failure(e)


def restore_dir(output_dir: str, step: int = 0) -> Optional[str]:
    """The Trainer checkpoint of the newest step complete in the tier (or of
    ``step``), unpacked as ``<output_dir>/warden-restore/rank-<R>/checkpoint-N``
    for ``trainer.train(resume_from_checkpoint=...)``; None on a fresh start.
    Raises ``warden.checkpoint.CheckpointError`` when the agent cannot be
    reached (a resume that silently started over would be worse). This
    process's copy in flight is committed first."""
    _say_failure(_copier.wait())
    r = _ckpt.restore(step, rank=0)
    if r is None:
        return None
    _job, rank, _world = _ckpt.identity()
    root = os.path.join(output_dir, "warden-restore", f"rank-{rank}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    unpack(r.path, root)
    path = os.path.join(root, f"{PREFIX}-{r.step}")
    if not os.path.isdir(path):
        raise _ckpt.CheckpointError(
            f"restore_dir: rank 0's shard of step {r.step} holds no {PREFIX}-{r.step} directory"
        )
    return path


class WardenCallback(_tf.TrainerCallback):
    """Reports steps and sections to the agent, and copies each saved
    checkpoint into its tier. ``client``: an explicit ``warden.connect(...)``
    client (default: the module-level one). ``save_to_tier=False`` keeps the
    checkpoints on disk only. ``async_copy=False`` copies on the training
    thread (see the module's notes)."""

    def __init__(self, save_to_tier: bool = True, client: Any = None, async_copy: bool = True) -> None:
        self.save_to_tier = save_to_tier
        self.async_copy = bool(async_copy)
        self._client = client
        self._tracker: Optional[StepTracker] = None
        self._hooks: list[Any] = []
        #: The last step copied into the tier (None: none yet by this callback).
        self.last_saved: Optional[int] = None
        #: The step saved on a notice of a coming stop (None: no notice yet).
        self.preempted: Optional[int] = None

    @property
    def _steps(self) -> StepTracker:
        if self._tracker is None:
            self._tracker = StepTracker(self._client)
        return self._tracker

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Hooks the model's forward, so that it is timed as its own section."""
        self._remove_hooks()
        if model is None:
            return
        self._hooks = [
            model.register_forward_pre_hook(self._forward_begins),
            model.register_forward_hook(self._forward_ends),
        ]

    def _forward_begins(self, module: Any, args: Any) -> None:
        if self._steps.step is not None and module.training:
            self._steps.enter("forward")

    def _forward_ends(self, module: Any, args: Any, output: Any) -> None:
        if self._steps.step is not None and module.training:
            self._steps.enter("backward")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An optimizer step begins (its first micro-batch); under
        ``WardenTrainer``, its RNGs are seeded from (seed, rank, step)."""
        self._steps.begin(state.global_step)
        if _HEAL.active:
            _HEAL.step_begins(int(state.global_step))

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A micro-batch of gradient accumulation is done."""
        self._steps.leave()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Gradients are in (and clipped): the optimizer steps. Under
        ``WardenTrainer`` a restart now waits for the step's commit."""
        self._steps.enter("optimizer")
        if _HEAL.active:
            _HEAL.begin_update()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The optimizer stepped."""
        self._steps.leave()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The step is done (the scheduler stepped, the gradients zeroed). On a
        notice of a coming stop naming this step, the Trainer saves (``on_save``
        copies it into the tier) and stops; ``on_train_end`` leaves with 85.
        Under ``WardenTrainer`` the step is committed: the state in memory is
        that of ``global_step`` steps (a restart that arrived during the
        update is raised here, the step done)."""
        self._steps.end()
        if _HEAL.active:
            _HEAL.commit(int(state.global_step))
        n = _notice()
        if n is not None and n.due(int(state.global_step)) and self.preempted is None:
            self.preempted = int(state.global_step)
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer saved ``checkpoint-N``: a copy goes into the tier as step N."""
        step = int(state.global_step)
        if _saver.handed == step:
            # WardenTrainer's async save writes the checkpoint and copies it.
            _saver.handed = None
            self.last_saved = step
            return
        if not self.save_to_tier:
            return
        if step < 1 or step == self.last_saved:
            return
        src = os.path.join(args.output_dir, f"{PREFIX}-{step}")
        if self.async_copy:
            started = time.perf_counter()
            with _section("checkpoint"):
                # Back pressure: the copy before this one, finished first.
                _say_failure(_copier.wait())
                try:
                    snap = _snapshot(src, args.output_dir, step) if args.should_save else None
                    _copier.start(step, snap, tar_size(snap), time.perf_counter() - started)
                except (_ckpt.CheckpointError, OSError) as e:
                    warnings.warn(f"warden: checkpoint of step {step} not copied to the tier: {e}", stacklevel=2)
                    return
            self.last_saved = step
            return
        with _section("checkpoint"):
            try:
                packed = src if args.should_save else None
                _ckpt.save_file(step, lambda p: _pack(packed, p), size_hint=tar_size(packed))
            except (_ckpt.CheckpointError, OSError) as e:
                warnings.warn(f"warden: checkpoint of step {step} not copied to the tier: {e}", stacklevel=2)
                return
        self.last_saved = step

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Nothing stays open, and the model's hooks go."""
        if self._tracker is not None:
            self._tracker.end()
        self._remove_hooks()
        # The last copy committed before training returns (and before
        # leaving on a notice: the step it saved must be in the tier).
        _settle(_copier.wait())
        if self.preempted is not None:
            raise _Preempted(self.preempted)

    def abandon(self) -> None:
        """Closes what is open and drops the model's hooks: call it from
        ``warden.run``'s ``on_restart`` when the Trainer is kept across
        attempts (the Trainer has no callback event for an exception)."""
        if self._tracker is not None:
            self._tracker.abandon()
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _pack(src: Optional[str], path: str) -> None:
    """The Trainer's checkpoint directory ``src`` packed at ``path``."""
    pack(src, path, "the Trainer's checkpoint")


def _ensure_group(args: Any) -> bool:
    """This attempt's process group, made by ``warden.heal.init_process_group``
    (a store of its own per attempt, which no rank's death takes down) when
    the process is one rank of several and no group exists yet; Accelerate's
    ``PartialState`` then finds it made and only reads its ranks. Returns
    whether a group exists."""
    import torch  # noqa: PLC0415

    dist = torch.distributed
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return True
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return False
    import warden.heal  # noqa: PLC0415

    cuda = torch.cuda.is_available() and not getattr(args, "use_cpu", False)
    backend = getattr(args, "ddp_backend", None) or ("nccl" if cuda else "gloo")
    warden.heal.init_process_group(backend, timeout_s=float(getattr(args, "ddp_timeout", 1800) or 1800))
    return True


@dataclass
class WardenTrainingArguments(_tf.TrainingArguments):
    """``TrainingArguments`` whose device setup makes the attempt's process
    group with ``warden.heal.init_process_group`` first (``TrainingArguments``
    sets up its devices when made, and Accelerate's ``PartialState`` would
    otherwise make the group itself, on a store hosted by rank 0 at
    ``MASTER_PORT``: a lost rank 0 takes it down, and a replacement would
    wait there for peers that are not coming). Make them in the training
    function, with the Trainer: each attempt then has its own group. Every
    field is ``TrainingArguments``'."""

    @cached_property
    def _setup_devices(self) -> Any:
        _debug(os.environ.get("RANK", "?"), "TrainingArguments: the process group")
        _ensure_group(self)
        _debug(os.environ.get("RANK", "?"), "TrainingArguments: the group made")
        return _tf.TrainingArguments._setup_devices.func(self)


class WardenTrainer(_tf.Trainer):
    """A ``Trainer`` healed from a live replica (``warden.heal``), for DDP.

    With a ``WardenCallback`` among its callbacks and ``WardenTrainingArguments``
    (or a process group made before ``TrainingArguments``), under
    ``warden.run`` and ``warden run``: at every ``train``, before DDP wraps the
    model, the ranks behind (a replacement, a survivor interrupted during its
    optimizer update) receive model, optimizer, LR scheduler and the
    Trainer's progress (global step, epoch) from the lowest live rank at the
    newest committed step, and the survivors keep theirs in memory; the
    epoch's batches already consumed are skipped by index. Where no live
    rank holds the state, the tier's newest checkpoint is restored
    (``restore_dir``), as ``train(resume_from_checkpoint=...)`` would. Call
    ``train()`` without ``resume_from_checkpoint``. Each step's RNGs are
    seeded from (``args.seed``, rank, step) (``warden.heal.seed_step``), so a
    replacement draws what the lost rank would have. One process (no group):
    no replica to heal from, ``train`` resumes from the tier.

    ``async_save`` (default True; with ``WardenCallback(async_copy=True)``):
    each checkpoint holds the step only while its tensors are copied into a
    buffer, and ``checkpoint-N`` is written, copied into the tier and the old
    ones rotated in the background (``_transformers_save``); a write that
    failed is raised by the next save or at the end of training. The other
    arguments are ``Trainer``'s.
    """

    def __init__(self, *args: Any, async_save: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.warden_async_save = bool(async_save)
        self._warden_prepared = False

    def _warden_async_callback(self) -> Optional["WardenCallback"]:
        """The ``WardenCallback`` whose saves this Trainer writes in the
        background, or None where its own save runs."""
        cb = next((c for c in self.callback_handler.callbacks if isinstance(c, WardenCallback)), None)
        if not self.warden_async_save or cb is None or not cb.async_copy or not _async_supported(self):
            return None
        return cb

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, written in the background where it can
        be (see ``async_save``), else the Trainer's own save."""
        cb = self._warden_async_callback()
        if cb is None:
            # The Trainer's own save: whatever is still being written first.
            _settle(_copier.wait())
            return super()._save_checkpoint(model, trial)
        _saver.save(self, trial, _copier, cb.save_to_tier, _settle)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's step; once the optimizer's state is made
        (``optimizer_state_made``; by the ``PREPARE_BY``-th optimizer step in
        any case), the background save's buffer is made ahead on a thread of
        its own (``TrainerSaver.prepare``), where this Trainer saves in the
        background at all and a save is due before ``max_steps``."""
        if not self._warden_prepared and self.state.global_step > 0:
            self._warden_prepare_when_ready()
        return super().training_step(*args, **kwargs)

    def _warden_prepare_when_ready(self) -> None:
        from ..async_checkpoint import prepare_once_ready  # noqa: PLC0415

        args = self.args
        steps_due = args.save_strategy == "steps" and args.save_steps >= 1
        if (
            not args.should_save
            or args.save_strategy == "no"
            or (steps_due and 0 < self.state.max_steps < args.save_steps)
            or self._warden_async_callback() is None
        ):
            self._warden_prepared = True  # nothing to make ahead
            return
        self._warden_prepared = prepare_once_ready(
            self.state.global_step, [self.optimizer], lambda: _saver.prepare(self)
        )

    def _load_best_model(self) -> None:
        """The best checkpoint, once its background write is done."""
        _settle(_copier.wait())
        return super()._load_best_model()

    def train(
        self,
        resume_from_checkpoint: Any = None,
        trial: Any = None,
        ignore_keys_for_eval: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Heals this rank (or falls back to the tier), then trains."""
        if resume_from_checkpoint:
            raise ValueError(
                "warden: WardenTrainer heals from a live replica and falls back to the tier by itself: "
                f"call train() without resume_from_checkpoint (got {resume_from_checkpoint!r})"
            )
        if self.model_init is not None or trial is not None:
            raise ValueError(
                "warden: WardenTrainer heals the model it was given: model_init and hyper-parameter "
                "trials make a model anew inside train(), after the heal"
            )
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            raise ValueError("warden: WardenTrainer heals DDP only (not DeepSpeed or FSDP)")
        if not any(isinstance(c, WardenCallback) for c in self.callback_handler.callbacks):
            raise ValueError("warden: WardenTrainer heals only with a WardenCallback in the Trainer's callbacks")
        if not _ensure_group(self.args):
            # One process: no replica; the tier's newest checkpoint, if any.
            return super().train(
                resume_from_checkpoint=restore_dir(self.args.output_dir),
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        tier = _HEAL.before_train(self, restore_dir)
        _HEAL.active = True
        try:
            return super().train(resume_from_checkpoint=tier, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        except BaseException:
            self._warden_drop()
            raise
        finally:
            _HEAL.train_ended()

    def _warden_drop(self) -> None:
        """An exception (a restart) ended ``train``: the callbacks' sections
        closed, and the DDP wrapper let go (it holds the aborted group, whose
        sockets a peer may be waiting on)."""
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, WardenCallback):
                cb.abandon()
        self.model_wrapped = self.model
        self.optimizer = None
        self.lr_scheduler = None
        free = getattr(getattr(self, "accelerator", None), "free_memory", None)
        if callable(free):
            free()

    # -- the Trainer's inner loop (private methods of Transformers 5.23.0) --------

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: Any,
        trial: Any,
    ) -> Any:
        """The Trainer's fresh ``TrainerState``, then, in a live heal, its
        progress from memory and the batches of the epoch to skip."""
        got = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if _HEAL.active:
            healed = _HEAL.training_state(self, num_update_steps_per_epoch)
            if healed is not None:
                return healed
        return got

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        """Optimizer and scheduler made, the model prepared: in a live heal
        they take the state kept in memory or received."""
        out = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if _HEAL.active:
            _HEAL.after_prepare(self)
        return out

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """In a live heal, the epoch resumed skips the batches it consumed
        (the Trainer does so only when it resumes from a checkpoint)."""
        if _HEAL.active and _HEAL.mode == "live" and kwargs.get("resume_from_checkpoint") is None:
            kwargs["resume_from_checkpoint"] = _LIVE
        return super()._run_epoch(*args, **kwargs)

    def _load_rng_state(self, checkpoint: Any) -> None:
        """No RNG file for a state from memory: each step's RNG is seeded from the step."""
        if checkpoint is _LIVE:
            return
        super()._load_rng_state(checkpoint)
