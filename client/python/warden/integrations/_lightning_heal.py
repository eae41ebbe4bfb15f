"""A Lightning DDP or HSDP fit healed from a live replica (``warden.heal`` under Lightning).

In: the hooks of ``WardenDDPStrategy`` (before DDP wraps the module, and
once Lightning made the fit's optimizers), of
``WardenModelParallelStrategy(heal=True)`` (once Lightning sharded the module
and made the fit's optimizers: FSDP2 in replica groups, where each rank
sends and receives only its own shards, ``after_sharded_setup``) and of
``WardenCallback`` (a step
begins, the optimizer is about to update, the step is done, the training
starts, an exception ended the fit), in every attempt of the training
function under ``warden.run``.
Out: one ``warden.heal.State`` per process, declared at the first fit, whose
model is the LightningModule, whose "optimizer" is every optimizer and LR
scheduler of the attempt's fit (``_Optimizers``), and whose "data" is the
fit loop's progress and the callbacks' state (``state_dict``, by
``state_key``: a counter, EarlyStopping's patience, ModelCheckpoint's best)
as of the last committed step (``_Loops``). At each
attempt the survivors keep their module and their optimizers' state in
memory, the ranks behind receive the newest committed state from a live
peer over the attempt's new group (``State.resume``), and Lightning's own
restore (``restore_training_state``) loads the loops, optimizers and
schedulers into the new Trainer from that in-memory dictionary, and the
attempt's callbacks (new on every rank) load theirs; the
batches the epoch already consumed are skipped by index, none loaded.
Where no live rank holds the state, the tier's newest checkpoint is
restored instead (``restore_path``). Never: reads a checkpoint while a live
replica holds the state, keeps a reference to a Trainer past its fit (it
holds the DDP wrapper, and the wrapper the aborted group), or lets a
restart land inside an optimizer update unseen.

Lightning internals this relies on (tested with PyTorch Lightning 2.6.6,
pinned in tests/frameworks/requirements.txt): ``trainer._checkpoint_connector``
(its ``_loaded_checkpoint``, which ``restore_training_state`` reads after
``on_fit_start``, and ``restore_callbacks`` on a fall-back to the tier) and
``trainer.fit_loop._data_fetcher`` (its iterator made again after the skip).
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import checkpoint as _ckpt
from .. import heal as _heal
from .. import heal_layout as _heal_layout


def _say(line: str) -> None:
    print(f"warden.heal: {line}", file=sys.stderr, flush=True)


class _Optimizers:
    """Every optimizer and LR scheduler of the attempt's fit, as the
    ``optimizer`` of ``warden.heal.State``.

    Lightning makes the optimizers anew in each fit (``configure_optimizers``),
    after the heal has to run (before DDP wraps the module: its constructor
    broadcasts rank 0's weights, which a replacement rank 0 has not got yet).
    So this keeps the last fit's objects, whose state is this survivor's own,
    until the next fit's exist; a peer's state received meanwhile waits in
    ``pending``. ``take`` hands the new fit the state it starts from.
    """

    def __init__(self) -> None:
        self.optimizers: List[Any] = []
        self.schedulers: List[Any] = []
        #: A state to load into the next fit's optimizers (a peer's, or the tier's).
        self.pending: Optional[Dict[str, Any]] = None
        self._hooks: List[Callable[..., None]] = []

    def register_step_pre_hook(self, fn: Callable[..., None]) -> None:
        # Not on the torch optimizers: Lightning runs forward and backward in
        # the optimizer's closure, inside ``optimizer.step``, so its pre-hook
        # fires before the forward and would defer every restart to the end
        # of the step (a survivor blocked in DDP's all-reduce could never
        # take one). ``begin_update`` calls it once gradients are in.
        self._hooks.append(fn)

    def begin_update(self) -> None:
        for fn in self._hooks:
            fn()

    def state_dict(self) -> Dict[str, Any]:
        if self.pending is not None:
            return self.pending
        return {
            "optimizer_states": [o.state_dict() for o in self.optimizers],
            "lr_schedulers": [s.state_dict() for s in self.schedulers],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.pending = state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    # -- FSDP2 (``WardenModelParallelStrategy``): each rank its own shards ----

    def local_state_dict(self) -> Tuple[Dict[str, Any], List[List[Any]]]:
        """What ``warden.heal_layout.local_state_dict`` sends of these
        optimizers: each one's state with its DTensors as local shards, the
        schedulers' states, and the DTensor entries as (optimizer, param
        index, key)."""
        states: List[Dict[str, Any]] = []
        marks: List[List[Any]] = []
        for i, o in enumerate(self.optimizers):
            state, marked = _heal_layout.optimizer_local_state(o)
            states.append(state)
            marks.extend([i, *m] for m in marked)
        return {"optimizer_states": states, "lr_schedulers": [s.state_dict() for s in self.schedulers]}, marks

    def load_local_state_dict(self, state: Dict[str, Any], marks: List[List[Any]]) -> None:
        """A peer's ``local_state_dict`` loaded into this fit's optimizers and
        schedulers (they exist: a sharded fit heals after Lightning made
        them), each optimizer's shards made DTensors on this rank's mesh."""
        states = state.get("optimizer_states") if isinstance(state, dict) else None
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            have = len(states) if isinstance(states, list) else "no"
            raise _heal_layout.LayoutError(
                f"the received state has {have} optimizer states, this fit has {len(self.optimizers)} optimizers"
            )
        for i, o in enumerate(self.optimizers):
            mine = [m[1:] for m in marks if isinstance(m, (list, tuple)) and len(m) == 3 and m[0] == i]
            _heal_layout.load_optimizer_local_state(o, states[i], mine)
        for s, sd in zip(self.schedulers, state.get("lr_schedulers", [])):
            s.load_state_dict(sd)

    def bind(self, trainer: Any) -> None:
        """This fit's optimizers and schedulers, now the ones kept, starting
        from the state the last fit's left in memory (a survivor's; none on a
        fresh start or in a replacement)."""
        old = self.state_dict() if self.optimizers else None
        self.pending = None
        self.optimizers = list(trainer.optimizers)
        self.schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        if old is None:
            return
        for o, sd in zip(self.optimizers, old["optimizer_states"]):
            o.load_state_dict(sd)
        for s, sd in zip(self.schedulers, old["lr_schedulers"]):
            s.load_state_dict(sd)

    def take(self, trainer: Any) -> Optional[Dict[str, Any]]:
        """The state the new fit's optimizers start from (None: their own,
        a fresh start), and binds them: they are the ones kept from now on."""
        got = self.pending if self.pending is not None else (self.state_dict() if self.optimizers else None)
        self.pending = None
        self.optimizers = list(trainer.optimizers)
        self.schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        return got


class _Loops:
    """The fit loop's progress (step, epoch, batch position), as the ``data``
    of ``warden.heal.State``: read at each commit from the attempt's Trainer,
    and, once an attempt ended, what the next fit restores (``pending``)."""

    def __init__(self) -> None:
        #: The Trainer whose fit runs now (None between fits).
        self.trainer: Any = None
        #: Progress to restore into the next fit (empty: a fresh start).
        self.pending: Optional[Dict[str, Any]] = None

    def state_dict(self) -> Dict[str, Any]:
        if self.pending is not None or self.trainer is None:
            return self.pending or {}
        t = self.trainer
        # What Lightning's own checkpoint holds of the loops (dump_checkpoint).
        out: Dict[str, Any] = {
            "epoch": t.current_epoch,
            "global_step": t.global_step,
            "loops": {"fit_loop": t.fit_loop.state_dict()},
        }
        prec = t.precision_plugin.state_dict()
        if prec:
            out[t.precision_plugin.__class__.__qualname__] = prec
        callbacks = _callbacks_state(t)
        if callbacks:
            out["callbacks"] = callbacks
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.pending = state


def _progress_of(ckpt: Dict[str, Any]) -> Dict[str, Any]:
    """What a Lightning checkpoint holds besides module, optimizers,
    schedulers and callbacks: the loops' progress and the rest Lightning's
    restore reads."""
    return {
        k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states", "lr_schedulers", "callbacks")
    }


def _callbacks_state(trainer: Any) -> Dict[str, Any]:
    """Every callback's ``state_dict``, by its ``state_key``: what Lightning's
    checkpoint holds under "callbacks" (``_call_callbacks_state_dict``)."""
    out: Dict[str, Any] = {}
    for cb in trainer.callbacks:
        state = cb.state_dict()
        if state:
            out[cb.state_key] = state
    return out


def _load_callbacks(trainer: Any, states: Dict[str, Any]) -> None:
    """Each callback's state loaded, by its ``state_key``, as Lightning's
    restore does (``_call_callbacks_load_state_dict``); a callback without a
    state there keeps its own."""
    import copy  # noqa: PLC0415

    for cb in trainer.callbacks:
        state = states.get(cb.state_key, states.get(getattr(cb, "_legacy_state_key", None)))
        if state:
            cb.load_state_dict(copy.deepcopy(state))


class LightningHeal:
    """The process's heal of its Lightning fits (one per process: a
    survivor's state outlives each attempt's Trainer)."""

    def __init__(self) -> None:
        self.state: Optional[_heal.State] = None
        self.optimizers = _Optimizers()
        self.loops = _Loops()
        #: The tier's checkpoint of a fall-back, for the callbacks' state.
        self._from_tier: Optional[Dict[str, Any]] = None

    # -- WardenDDPStrategy.setup --------------------------------------------

    def before_ddp(self, trainer: Any, module: Any, seed: int, restore_path: Callable[..., Optional[str]]) -> None:
        """Declares the state at the first fit; in every fit, brings this
        rank to the newest committed step a live replica holds (or the
        tier's), before DDP wraps the module."""
        if trainer.ckpt_path:
            raise ValueError(
                "warden: WardenDDPStrategy heals from a live replica and falls back to the tier by itself: "
                f"call trainer.fit without ckpt_path (got {trainer.ckpt_path!r})"
            )
        if self.state is None:
            self.state = _heal.declare(module, self.optimizers, data=self.loops, rng="step", seed=seed)
        elif self.state.model is not module:
            # A module made anew in this attempt: the survivor's weights are
            # the old one's, copied in memory.
            module.load_state_dict(self.state.model.state_dict())
            self.state.model = module
        self.loops.trainer = None
        self._from_tier = None
        self.state.resume(lambda: self._restore(trainer, module, restore_path))

    def _restore(self, trainer: Any, module: Any, restore_path: Callable[..., Optional[str]]) -> Optional[int]:
        """No live replica: the tier's newest checkpoint, loaded as
        ``fit(ckpt_path=...)`` would (module now, the rest at ``after_setup``);
        its step agreed by every rank first (every rank is here: the heal's
        plan is the same on each)."""
        step = _ckpt.agreed_step()
        path = None if step is None else restore_path(step=step)
        if path is None:
            return None
        ckpt = trainer.strategy.load_checkpoint(path)
        module.on_load_checkpoint(ckpt)
        trainer.strategy.load_model_state_dict(ckpt, strict=module.strict_loading)
        self.optimizers.pending = {
            "optimizer_states": ckpt.get("optimizer_states", []),
            "lr_schedulers": ckpt.get("lr_schedulers", []),
        }
        self.loops.pending = _progress_of(ckpt)
        self._from_tier = ckpt
        return int(ckpt["global_step"])

    def after_setup(self, trainer: Any) -> None:
        """The fit's optimizers exist: Lightning's own restore will load the
        healed loops, optimizers and schedulers from memory."""
        optim = self.optimizers.take(trainer)
        loops, self.loops.pending = self.loops.pending, None
        self.loops.trainer = trainer
        if not loops or optim is None:
            return  # a fresh start
        ckpt: Dict[str, Any] = dict(loops)
        ckpt.update(optim)
        callbacks = ckpt.pop("callbacks", None)
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = ckpt
        if self._from_tier is not None:
            connector._loaded_checkpoint = dict(self._from_tier, **ckpt)
            connector.restore_callbacks()
            self._from_tier = None
        elif callbacks:
            # The callbacks' state as of the committed step (a counter,
            # EarlyStopping's patience, ModelCheckpoint's best): this
            # attempt's callbacks are new on every rank.
            _load_callbacks(trainer, callbacks)

    # -- WardenModelParallelStrategy.setup (FSDP2 / HSDP) --------------------

    def after_sharded_setup(
        self, trainer: Any, module: Any, seed: int, restore_path: Callable[..., Optional[str]]
    ) -> None:
        """A sharded fit (FSDP2 over the strategy's device mesh): once
        Lightning sharded the module (``configure_model``) and made the fit's
        optimizers, every rank behind receives its own shards of module and
        optimizers from a live rank of the same shard position, with the
        schedulers and the fit loop's progress; the survivors carry theirs
        into the fit's new optimizers. Lightning's restore after setup then
        loads the loops, schedulers and callbacks from memory."""
        if trainer.ckpt_path:
            raise ValueError(
                "warden: WardenModelParallelStrategy(heal=True) heals from a live replica and falls back to the "
                f"tier by itself: call trainer.fit without ckpt_path (got {trainer.ckpt_path!r})"
            )
        self.optimizers.bind(trainer)
        if self.state is None:
            self.state = _heal.declare(module, self.optimizers, data=self.loops, rng="step", seed=seed)
        elif self.state.model is not module:
            raise ValueError(
                "warden: WardenModelParallelStrategy(heal=True) heals the LightningModule its first fit sharded: "
                "make the module once per process (a survivor keeps it across attempts) and make "
                "configure_model do nothing when the module is sharded already"
            )
        self.loops.trainer = None
        self._from_tier = None
        self.state.resume(lambda: self._restore_sharded(trainer, restore_path))
        loops, self.loops.pending = self.loops.pending, None
        self.loops.trainer = trainer
        if not loops:
            return  # a fresh start
        ckpt: Dict[str, Any] = dict(self._from_tier or {})
        ckpt.update(loops)
        ckpt["lr_schedulers"] = [s.state_dict() for s in self.optimizers.schedulers]
        # What Lightning's restore of callbacks reads first (the checkpoint's
        # version): the state is this Lightning's own.
        package = sys.modules.get(type(trainer).__module__.split(".")[0])
        ckpt.setdefault("pytorch-lightning_version", getattr(package, "__version__", "0"))
        self._from_tier = None
        # The strategy restores after setup (restore_checkpoint_after_setup):
        # Lightning's restore loads the loops, the schedulers and the
        # callbacks from this; the optimizers' state is loaded already
        # (ModelParallelStrategy leaves them to its own load).
        trainer._checkpoint_connector._loaded_checkpoint = ckpt

    def _restore_sharded(self, trainer: Any, restore_path: Callable[..., Optional[str]]) -> Optional[int]:
        """No live replica: the tier's newest sharded checkpoint (its step
        agreed by every rank first), every rank's shards of module and
        optimizers loaded in place (the strategy's ``load_checkpoint``),
        the rest kept for Lightning's restore after setup."""
        step = _ckpt.agreed_step()
        path = None if step is None else restore_path(step=step)
        if path is None:
            return None
        ckpt = trainer.strategy.load_checkpoint(path)
        for s, sd in zip(self.optimizers.schedulers, ckpt.get("lr_schedulers", [])):
            s.load_state_dict(sd)
        self.loops.pending = _progress_of(ckpt)
        self._from_tier = ckpt
        return int(ckpt["global_step"])

    # -- WardenCallback -------------------------------------------------------

    def step_begins(self, step: int) -> None:
        """The RNGs of (seed, rank, step): a replica holds the model, not
        another rank's RNG, so each rank's is a function of the step."""
        assert self.state is not None
        _heal.seed_step(self.state.seed, self.state.rank, step)

    def begin_update(self) -> None:
        """Gradients are in, the optimizer updates: a restart now waits for the commit."""
        self.optimizers.begin_update()

    def commit(self, trainer: Any) -> None:
        """The optimizer step is done (``global_step`` moved): the state in
        memory is that of ``global_step`` steps. May raise the restart that
        arrived during the update."""
        assert self.state is not None
        self.state.commit(trainer.global_step - 1)

    def fit_ended(self) -> None:
        """Drops the Trainer (an exception or the end ended its fit)."""
        self.loops.trainer = None

    def position_data(self, trainer: Any) -> None:
        """A fit resumed mid-epoch: the train loaders skip the batches the
        epoch already consumed (by index: nothing is loaded), so every rank
        sees the batches a fault-free run would have. A loader Lightning can
        resume itself (``state_dict`` / ``load_state_dict``) is left to it."""
        fit_loop = trainer.fit_loop
        done = fit_loop.epoch_loop.batch_progress.current.processed
        if not fit_loop.restarting or done <= 0 or done >= trainer.num_training_batches:
            return
        loaders = _flatten(trainer.train_dataloader)
        if not loaders or all(hasattr(dl, "state_dict") and hasattr(dl, "load_state_dict") for dl in loaders):
            return
        epoch = fit_loop.epoch_progress.current.processed
        for dl in loaders:
            batch_sampler = getattr(dl, "batch_sampler", None)
            sampler = getattr(batch_sampler, "sampler", None)
            size = getattr(batch_sampler, "batch_size", None)
            if sampler is None or not isinstance(size, int):
                raise RuntimeError(
                    f"warden.heal: rank {self.state.rank if self.state else '?'}: cannot resume {type(dl).__name__} "
                    f"at batch {done} of epoch {epoch}: it has no batch sampler with a batch size (give it state_dict "
                    "and load_state_dict, and Lightning resumes it)"
                )
            for s in {id(x): x for x in (getattr(dl, "sampler", None), sampler)}.values():
                if callable(getattr(s, "set_epoch", None)):
                    s.set_epoch(epoch)
            batch_sampler.sampler = _SkipFirst(batch_sampler, sampler, done * size)
        # The iterator made in setup_data may hold indices drawn already
        # (worker processes prefetch): made again, it draws them anew.
        iter(fit_loop._data_fetcher)
        if os.environ.get("WARDEN_HEAL_DEBUG"):
            _say(f"rank {self.state.rank if self.state else '?'}: epoch {epoch} resumes at batch {done}")


class _SkipFirst:
    """A sampler that leaves out the first ``n`` indices of its sampler's
    next pass, then puts the sampler back in its batch sampler (one pass)."""

    def __init__(self, owner: Any, sampler: Any, n: int) -> None:
        self._owner = owner
        self._sampler = sampler
        self._n = n

    def __iter__(self) -> Any:
        self._owner.sampler = self._sampler
        return itertools.islice(iter(self._sampler), self._n, None)

    def __len__(self) -> int:
        # The whole pass: Lightning counts the batches of a resumed epoch
        # from the position it restored (its fetcher adds them).
        return len(self._sampler)

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self._sampler, "set_epoch", None)):
            self._sampler.set_epoch(epoch)


def _flatten(loaders: Any) -> List[Any]:
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return [x for v in loaders.values() for x in _flatten(v)]
    if isinstance(loaders, (list, tuple)):
        return [x for v in loaders for x in _flatten(v)]
    return [loaders]


#: The process's heal: a survivor's module and optimizers outlive the Trainers.
HEAL = LightningHeal()
