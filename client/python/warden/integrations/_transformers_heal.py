"""A Transformers Trainer healed from a live replica (``warden.heal`` under the Trainer).

In: the overrides of ``WardenTrainer`` (``train`` begins and ends, the
training state is made, the optimizer and scheduler exist after
``accelerator.prepare``) and of ``WardenTrainingArguments`` (the devices are
set up), and the events of ``WardenCallback`` (a step begins, the optimizer
is about to update, the step is done), in every attempt of the training
function under ``warden.run``.
Out: one ``warden.heal.State`` per process, declared at the first ``train``,
whose model is the Trainer's model (unwrapped), whose "optimizer" is the
attempt's optimizer and LR scheduler (``_Optimizers``), and whose "data" is
the Trainer's progress (``TrainerState``: global step, epoch, ...) as of the
last committed step (``_Progress``). At each attempt the survivors keep their
model and their optimizer's state in memory, the ranks behind receive the
newest committed state from a live peer over the attempt's new group
(``State.resume``), before DDP wraps the model; the Trainer's progress is
set from that state where it would have read ``trainer_state.json``, the new
optimizer and scheduler load theirs once made, and the batches the epoch
already consumed are skipped by index (the Trainer's own resume path,
``skip_first_batches``), none loaded. Where no live rank holds the state,
the tier's newest checkpoint is restored instead (``restore_dir``), the way
``train(resume_from_checkpoint=...)`` does. Never: reads a checkpoint while a
live replica holds the state, or lets a restart land inside an optimizer
update unseen.

Transformers internals this relies on (tested with Transformers 5.23.0 and
Accelerate 1.15.0, pinned in tests/frameworks/requirements.txt), all methods
of ``Trainer`` overridden by ``WardenTrainer``: ``_init_training_state``
(returns the epochs trained and the batches of the current epoch to skip),
``_prepare_for_training`` (makes the optimizer and scheduler and prepares the
model), ``_run_epoch`` (its ``resume_from_checkpoint`` argument, which turns on
the skip of the batches consumed) and ``_load_rng_state``; and
``TrainingArguments._setup_devices`` (a cached property that makes
Accelerate's ``PartialState``, which makes the process group when none is).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from .. import checkpoint as _ckpt
from .. import heal as _heal


def _say(line: str) -> None:
    print(f"warden.heal: {line}", file=sys.stderr, flush=True)


def _debug(rank: Any, what: str) -> None:
    """A timestamped line with ``WARDEN_HEAL_DEBUG`` set: where a heal's time goes."""
    if os.environ.get("WARDEN_HEAL_DEBUG"):
        _say(f"rank {rank}: {time.time():.6f} {what}")


#: The fields of ``TrainerState`` a heal carries: the progress, the same on
#: every rank. Not the configuration (max_steps, save_steps: each attempt's
#: arguments), not the rank's own flags, not the callbacks' states.
#: Besides these, the state of the callbacks that export one (``_callbacks_state``).
CARRIED = (
    "global_step",
    "epoch",
    "num_input_tokens_seen",
    "total_flos",
    "log_history",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
)


class LiveState:
    """What ``_run_epoch`` gets as ``resume_from_checkpoint`` when the state
    came from memory: not None, so the Trainer skips the batches the epoch
    consumed; ``_load_rng_state`` reads nothing for it (each step's RNG is
    seeded from the step)."""

    def __repr__(self) -> str:
        return "<warden: the state of a live replica>"


LIVE = LiveState()


class _Optimizers:
    """The attempt's optimizer and LR scheduler, as the ``optimizer`` of
    ``warden.heal.State``.

    The Trainer makes both anew in each ``train`` (``create_optimizer``,
    ``create_scheduler``), after the heal has to run (before DDP wraps the
    model: its constructor broadcasts rank 0's weights, which a replacement
    rank 0 has not got yet). So this keeps the last attempt's objects, whose
    state is this survivor's own, until the next attempt's exist; a peer's
    state received meanwhile waits in ``pending``.
    """

    def __init__(self) -> None:
        self.optimizer: Any = None
        self.scheduler: Any = None
        #: A state to load into the next attempt's optimizer (a peer's).
        self.pending: Optional[Dict[str, Any]] = None
        self._hooks: List[Callable[..., None]] = []

    def register_step_pre_hook(self, fn: Callable[..., None]) -> None:
        # Called by ``begin_update`` (``on_pre_optimizer_step``): the
        # attempt's optimizer is made after the declaration.
        self._hooks.append(fn)

    def begin_update(self) -> None:
        for fn in self._hooks:
            fn()

    def state_dict(self) -> Dict[str, Any]:
        if self.pending is not None:
            return self.pending
        return {
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "lr_scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.pending = state

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def take(self, optimizer: Any, scheduler: Any, load: bool) -> None:
        """Binds the new attempt's optimizer and scheduler (they are the ones
        kept from now on) and, with ``load``, loads into them the state they
        start from: a peer's, or this survivor's own from the last attempt."""
        got = self.pending if self.pending is not None else (self.state_dict() if self.optimizer is not None else None)
        self.pending = None
        self.optimizer, self.scheduler = optimizer, scheduler
        if not load or got is None:
            return
        if got.get("optimizer") is not None:
            optimizer.load_state_dict(got["optimizer"])
        if got.get("lr_scheduler") is not None and scheduler is not None:
            scheduler.load_state_dict(got["lr_scheduler"])


def _callbacks_state(trainer: Any) -> Dict[str, List[Dict[str, Any]]]:
    """The state of each callback that exports one (``ExportableState``:
    EarlyStoppingCallback's patience counter, a user's own), by class name,
    in the callbacks' order: what ``trainer_state.json`` holds under
    ``stateful_callbacks`` (the Trainer's control excluded: its flags are of
    the step, not of the run)."""
    exportable = getattr(sys.modules.get("transformers.trainer_callback"), "ExportableState", None)
    if exportable is None:
        return {}
    out: Dict[str, List[Dict[str, Any]]] = {}
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, exportable):
            out.setdefault(cb.__class__.__name__, []).append(cb.state())
    return out


def _load_callbacks(trainer: Any, states: Dict[str, List[Dict[str, Any]]]) -> None:
    """Each exported state set on this attempt's callback of that class (in
    order; the attributes only: the callback was made with its arguments)."""
    import copy  # noqa: PLC0415

    for name, kept in states.items():
        same = [cb for cb in trainer.callback_handler.callbacks if cb.__class__.__name__ == name]
        for cb, state in zip(same, kept):
            for attr, value in (state.get("attributes") or {}).items():
                setattr(cb, attr, copy.deepcopy(value))


class _Progress:
    """The Trainer's progress (``CARRIED`` of its ``TrainerState``), as the
    ``data`` of ``warden.heal.State``: read at each commit from the running
    Trainer, and, once an attempt ended, what the next ``train`` starts from
    (``pending``)."""

    def __init__(self) -> None:
        #: The Trainer whose ``train`` runs now (None between attempts).
        self.trainer: Any = None
        #: Progress to set in the next ``train`` (empty: a fresh start).
        self.pending: Optional[Dict[str, Any]] = None

    def state_dict(self) -> Dict[str, Any]:
        if self.pending is not None or self.trainer is None:
            return self.pending or {}
        st = self.trainer.state
        out = {k: getattr(st, k) for k in CARRIED}
        callbacks = _callbacks_state(self.trainer)
        if callbacks:
            out["callbacks"] = callbacks
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.pending = state


class TransformersHeal:
    """The process's heal of its Trainers (one per process: a survivor's
    model and optimizer state outlive each attempt's Trainer)."""

    def __init__(self) -> None:
        self.state: Optional[_heal.State] = None
        self.optimizers = _Optimizers()
        self.progress = _Progress()
        #: How this attempt's ``train`` starts: "live" (a replica's state, in
        #: memory), "tier" (a checkpoint directory) or "fresh".
        self.mode = "fresh"
        #: The tier's checkpoint directory of a fall-back.
        self.tier_dir: Optional[str] = None
        #: A ``WardenTrainer.train`` runs (the callback's hooks act only then).
        self.active = False

    # -- WardenTrainer.train, before the Trainer's own -------------------------

    def before_train(self, trainer: Any, restore_dir: Callable[..., Optional[str]]) -> Optional[str]:
        """Declares the state at the first ``train``; in every ``train``,
        brings this rank to the newest committed step a live replica holds
        (or the tier's). Returns the checkpoint directory the Trainer must
        resume from (a fall-back to the tier), else None."""
        model = trainer.model
        _debug(os.environ.get("RANK", "?"), "train() begins: the heal")
        if self.state is None:
            self.state = _heal.declare(
                model, self.optimizers, data=self.progress, rng="step", seed=int(trainer.args.seed)
            )
        elif self.state.model is not model:
            # A model made anew in this attempt: the survivor's weights are
            # the old one's, copied in memory.
            model.load_state_dict(self.state.model.state_dict())
            self.state.model = model
        self.progress.trainer = None
        self.mode, self.tier_dir = "live", None
        self.state.resume(lambda: self._restore(trainer, restore_dir))
        _debug(self.state.rank, f"resumed ({self.mode})")
        if self.mode == "tier":
            # Its model, optimizer and progress are loaded by the Trainer from
            # the directory, later: until its first commit this rank holds no
            # state a peer may take.
            self.state._consistent = False
        return self.tier_dir

    def _restore(self, trainer: Any, restore_dir: Callable[..., Optional[str]]) -> Optional[int]:
        """No live replica: the tier's newest checkpoint (its step agreed by
        every rank first: the heal's plan is the same on each), which the
        Trainer loads itself (``resume_from_checkpoint``); None on a fresh
        start."""
        self.optimizers.pending = None
        self.progress.pending = None
        step = _ckpt.agreed_step()
        path = None if step is None else restore_dir(trainer.args.output_dir, step=step)
        if path is None:
            self.mode = "fresh"
            return None
        self.mode, self.tier_dir = "tier", path
        name = os.path.basename(os.path.normpath(path))
        try:
            return int(name.rsplit("-", 1)[1])
        except (IndexError, ValueError):
            raise RuntimeError(f"warden.heal: the tier's checkpoint {path} is not named checkpoint-<step>") from None

    # -- WardenTrainer's overrides of the Trainer's inner loop -------------------

    def training_state(self, trainer: Any, num_update_steps_per_epoch: int) -> Optional[tuple]:
        """The Trainer made a fresh ``TrainerState``: in a live heal, its
        progress set from memory; returns (epochs trained, batches of the
        current epoch to skip), or None to keep the Trainer's."""
        got, self.progress.pending = self.progress.pending, None
        self.progress.trainer = trainer
        if self.mode != "live" or not got:
            return None
        st = trainer.state
        for k in CARRIED:
            if k in got:
                setattr(st, k, got[k])
        # The callbacks are this attempt's, on every rank: their state as of
        # the committed step.
        _load_callbacks(trainer, got.get("callbacks") or {})
        if st.log_history is None:
            st.log_history = []
        epochs = int(st.global_step // num_update_steps_per_epoch)
        skip = 0
        if not trainer.args.ignore_data_skip:
            skip = (st.global_step % num_update_steps_per_epoch) * trainer.args.gradient_accumulation_steps
        _debug(self.state.rank if self.state else "?", f"step {st.global_step}, epoch {epochs}, skips {skip} batches")
        return epochs, skip

    def after_prepare(self, trainer: Any) -> None:
        """The attempt's optimizer and scheduler exist: in a live heal they
        take the survivor's or the peer's state; from the tier, the Trainer
        loaded them from the directory."""
        self.optimizers.take(trainer.optimizer, trainer.lr_scheduler, load=self.mode == "live")
        _debug(self.state.rank if self.state else "?", "optimizer, scheduler and DDP ready")

    def train_ended(self) -> None:
        """Drops the Trainer (an exception or the end ended its ``train``)."""
        self.progress.trainer = None
        self.active = False

    # -- WardenCallback ---------------------------------------------------------

    def step_begins(self, step: int) -> None:
        """The RNGs of (seed, rank, step): a replica holds the model, not
        another rank's RNG, so each rank's is a function of the step."""
        if self.state is not None:
            _heal.seed_step(self.state.seed, self.state.rank, step)

    def begin_update(self) -> None:
        """Gradients are in, the optimizer updates: a restart now waits for the commit."""
        self.optimizers.begin_update()

    def commit(self, global_step: int) -> None:
        """The step is done (optimizer and scheduler stepped, ``global_step``
        moved): the state in memory is that of ``global_step`` steps. May
        raise the restart that arrived during the update."""
        if self.state is not None:
            self.state.commit(global_step - 1)


#: The process's heal: a survivor's model and optimizer outlive the Trainers.
HEAL = TransformersHeal()
