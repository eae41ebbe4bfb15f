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
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from typing import Any, Optional

from . import require
from ._steps import StepTracker
from ._tar import pack, tar_size, unpack
from .. import checkpoint as _ckpt
from .._notice import Preempted as _Preempted
from .._notice import notice as _notice
from .. import section as _section

_tf = require("transformers", "warden.integrations.transformers", "transformers accelerate")

__all__ = ["WardenCallback", "restore_dir"]

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

    def start(self, step: int, snapshot: Optional[str], size_hint: int) -> None:
        t = threading.Thread(
            target=self._run, args=(step, snapshot, size_hint), name="warden-tier-copy", daemon=True
        )
        with self._lock:
            self._thread = t
        t.start()

    def _run(self, step: int, snapshot: Optional[str], size_hint: int) -> None:
        try:
            _ckpt.save_file(step, lambda p: _pack(snapshot, p), size_hint=size_hint)
        except BaseException as e:  # noqa: BLE001 - said by the next caller
            with self._lock:
                self._error = e
        finally:
            if snapshot is not None:
                shutil.rmtree(os.path.dirname(snapshot), ignore_errors=True)


#: The process's background copier (shared by the callbacks of successive
#: in-process attempts).
_copier = _TierCopier()


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
        """An optimizer step begins (its first micro-batch)."""
        self._steps.begin(state.global_step)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A micro-batch of gradient accumulation is done."""
        self._steps.leave()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Gradients are in (and clipped): the optimizer steps."""
        self._steps.enter("optimizer")

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The optimizer stepped."""
        self._steps.leave()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The step is done (the scheduler stepped, the gradients zeroed). On a
        notice of a coming stop naming this step, the Trainer saves (``on_save``
        copies it into the tier) and stops; ``on_train_end`` leaves with 85."""
        self._steps.end()
        n = _notice()
        if n is not None and n.due(int(state.global_step)) and self.preempted is None:
            self.preempted = int(state.global_step)
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer saved ``checkpoint-N``: a copy goes into the tier as step N."""
        if not self.save_to_tier:
            return
        step = int(state.global_step)
        if step < 1 or step == self.last_saved:
            return
        src = os.path.join(args.output_dir, f"{PREFIX}-{step}")
        if self.async_copy:
            with _section("checkpoint"):
                # Back pressure: the copy before this one, finished first.
                _say_failure(_copier.wait())
                try:
                    snap = _snapshot(src, args.output_dir, step) if args.should_save else None
                    _copier.start(step, snap, tar_size(snap))
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
        _say_failure(_copier.wait())
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
