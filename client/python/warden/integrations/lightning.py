"""PyTorch Lightning: steps, sections and checkpoints through the local warden agent.

    import warden
    from warden.integrations.lightning import WardenCallback, restore_path

    def train():
        trainer = L.Trainer(max_steps=10_000, callbacks=[WardenCallback(every_n_steps=500)])
        trainer.fit(MyModule(), loader, ckpt_path=restore_path())   # None: a fresh start

    warden.run(train)     # in-process restarts: train() again, resuming from the tier

In: the Trainer's hooks. Out: one warden step per optimizer step
(``trainer.global_step``, micro-batches of gradient accumulation inside
it), the sections ``forward`` (from the batch's start to the loss),
``backward`` and ``optimizer``, and every ``every_n_steps`` a full Lightning
checkpoint (``trainer.save_checkpoint``: weights, optimizers, loops) saved
as the rank's shard of that step in the agent's tier, in section
``checkpoint``. Never: fails training because the agent is away (a save
that fails is a warning, and the next one tries again; the heartbeat calls
never raise), or leaves a section open after an exception.

Lightning writes the checkpoint on global rank 0 only; the other ranks
commit an empty shard so that the step is complete, and every rank
restores rank 0's shard (``restore_path``), told whole from sharded by its
own shard.

Saves are asynchronous where the strategy allows (one device, DDP, and
``ModelParallelStrategy`` with ``save_distributed_checkpoint=False``: the
strategies whose checkpoint is the one dictionary global rank 0 writes):
the step is held only while Lightning's checkpoint dictionary is built and
its tensors copied into a buffer of the process's ``AsyncCheckpointer``
(reused across saves and in-process restarts); the shard is written and
committed in the background. ``restore_path`` first waits for this
process's saves in flight, and turns an async shard back into a file
``trainer.fit(ckpt_path=...)`` reads. ``FSDPStrategy`` with whole state
dictionaries saves synchronously, as does
``async_save=False``. A save that fails in the background is never
committed; the next save warns of it, as a synchronous failure does.
``WardenModelParallelStrategy`` (``ModelParallelStrategy``'s arguments)
saves its sharded checkpoint, the default, as one DCP save into the tier
(``_lightning_sharded``; each rank's shards, in the background by default),
and ``fit(ckpt_path=restore_path())`` loads it back. Other strategies that
write a folder of files (``ModelParallelStrategy``'s default, sharded FSDP,
DeepSpeed) are refused: the tier takes one file a rank. Uses ``lightning.pytorch``
when the ``lightning`` package is installed, else ``pytorch_lightning``.

With ``strategy=WardenDDPStrategy()`` the fit heals from a live replica
instead of resuming from the tier (``_lightning_heal``): survivors keep
their module and optimizer state, a replacement takes them and the fit
loop's progress from a peer; ``fit`` is then called without ``ckpt_path``.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import threading
import warnings
from typing import Any, Optional, Tuple

from .. import _agree
from . import _lightning_sharded as _sharded
from . import require
from ._lightning_heal import HEAL as _HEAL
from ._steps import StepTracker
from .. import checkpoint as _ckpt
from .. import section as _section
from .._notice import Preempted as _Preempted
from .._notice import notice as _notice

if importlib.util.find_spec("lightning") is not None:
    _pl = require("lightning.pytorch", "warden.integrations.lightning", "lightning")
else:
    _pl = require("pytorch_lightning", "warden.integrations.lightning", "pytorch-lightning")

__all__ = ["WardenCallback", "WardenDDPStrategy", "WardenModelParallelStrategy", "restore_path"]


#: The process's async saver: made on the first async save, reused by every
#: callback after it (an in-process restart makes a new callback).
_saver: Any = None
_saver_lock = threading.Lock()


def _async_saver() -> Any:
    global _saver
    with _saver_lock:
        if _saver is None:
            from ..async_checkpoint import AsyncCheckpointer  # noqa: PLC0415

            _saver = AsyncCheckpointer(max_in_flight=1)
        return _saver


def _wait_for_saves() -> None:
    """This process's async saves in flight, committed (a failure warned)."""
    _sharded.wait()
    saver = _saver
    if saver is None:
        return
    try:
        saver.wait()
    except _ckpt.CheckpointError as e:
        warnings.warn(f"warden: {e}", stacklevel=3)


def restore_path(step: int = 0) -> Optional[str]:
    """The Lightning checkpoint of the newest step complete in the tier (or
    of ``step``), as a local file for ``trainer.fit(ckpt_path=...)``; None on
    a fresh start. Raises ``warden.checkpoint.CheckpointError`` when the
    agent cannot be reached (a resume that silently started over would
    be worse). This process's async saves in flight are committed first,
    so an in-process restart resumes from the newest one.

    Every rank saves a shard of each step (an empty one beside rank 0's
    whole checkpoint), so the format is read from this rank's own: a
    sharded step (``WardenModelParallelStrategy``) is then never fetched
    whole from rank 0, which on a job of N hosts would be N copies of rank
    0's shard out of the hosts that hold it."""
    _wait_for_saves()
    from .. import async_checkpoint as _async  # noqa: PLC0415

    from . import dcp as _dcp  # noqa: PLC0415

    try:
        own = _ckpt.restore(step)
    except _ckpt.CheckpointError:
        # No shard of this rank in the step (the job grew since: a rank
        # past the world size saved): rank 0's alone tells. Where the agent
        # cannot be reached, that restore raises too.
        own = None
    if own is not None and _dcp.is_dcp_shard(own.path):
        # A sharded save (WardenModelParallelStrategy): each rank reads its
        # shards through the tier; Lightning gets the step's id.
        return _dcp.checkpoint_id(own.step)
    if own is None:
        r = _ckpt.restore(step, rank=0)
    else:
        # A whole checkpoint is rank 0's, of the step just found.
        r = own if _ckpt.identity()[1] == 0 else _ckpt.restore(own.step, rank=0)
    if r is None:
        return None
    if _dcp.is_dcp_shard(r.path):
        return _dcp.checkpoint_id(r.step)
    if not _async.is_async_shard(r.path):
        return r.path
    return _as_lightning_file(r.path, r.step)


def _as_lightning_file(path: str, step: int) -> str:
    """An async shard written back as the ``torch.save`` file Lightning
    loads, in a folder private to this user (removed at exit)."""
    import torch  # noqa: PLC0415

    from .. import async_checkpoint as _async  # noqa: PLC0415

    state = _async.read_shard(path, safe_globals=_lightning_safe_globals())
    folder = tempfile.mkdtemp(prefix="warden-lightning-")
    out = os.path.join(folder, f"step-{step}.ckpt")
    torch.save(state, out)
    import atexit  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    atexit.register(shutil.rmtree, folder, True)
    return out


def _lightning_safe_globals() -> list:
    """What a Lightning checkpoint's structure holds besides containers and
    numbers (its hyper-parameters' dictionary type)."""
    try:
        from lightning_fabric.utilities.data import AttributeDict  # noqa: PLC0415
    except ImportError:  # pragma: no cover - depends on the installed Lightning
        try:
            from lightning.fabric.utilities.data import AttributeDict  # noqa: PLC0415
        except ImportError:
            return []
    return [AttributeDict]


#: How a strategy's checkpoint is saved (``_route``).
_WHOLE = "whole"
_SHARDED = "sharded"
_FILES = "files"
_REFUSED = "refused"


def _route(trainer: Any) -> Tuple[str, Optional[str]]:
    """How the strategy's checkpoint is saved, and for a refusal why:
    - ``_WHOLE``: the one dictionary global rank 0 writes (one device, DDP,
      and ``ModelParallelStrategy`` (FSDP2) with
      ``save_distributed_checkpoint=False``, its state dictionaries gathered
      whole to rank 0, as ``trainer.save_checkpoint`` gathers them), which
      can be snapshotted and written in the background;
    - ``_SHARDED``: ``WardenModelParallelStrategy``'s default, one DCP save
      of each rank's shards (``_lightning_sharded``);
    - ``_REFUSED``: a strategy that writes a folder of files (each rank its
      shards, rank 0 the metadata) where the tier takes one file a rank,
      said with the setting that makes it one file;
    - ``_FILES``: any other, ``trainer.save_checkpoint`` into the tier's
      staging file on the training thread."""
    strategy = getattr(trainer, "strategy", None)
    name = type(strategy).__name__
    model_parallel = getattr(_pl.strategies, "ModelParallelStrategy", None)
    if model_parallel is not None and isinstance(strategy, model_parallel):
        if not getattr(strategy, "_save_distributed_checkpoint", True):
            return _WHOLE, None
        if isinstance(strategy, WardenModelParallelStrategy):
            return _SHARDED, None
        return _REFUSED, (
            f"{name}(save_distributed_checkpoint=True), the default, writes a folder of shards, "
            "which warden's tier does not take: use warden's WardenModelParallelStrategy (the "
            "same arguments; each rank's shards saved into the tier), or pass "
            "save_distributed_checkpoint=False (whole state dictionaries on rank 0)"
        )
    fsdp = getattr(_pl.strategies, "FSDPStrategy", None)
    if fsdp is not None and isinstance(strategy, fsdp):
        if getattr(strategy, "_state_dict_type", "full") == "sharded":
            return _REFUSED, (
                f'{name}(state_dict_type="sharded") writes a folder of shards, which warden\'s tier '
                'does not take: pass state_dict_type="full"'
            )
        return _FILES, None
    deepspeed = getattr(_pl.strategies, "DeepSpeedStrategy", None)
    if deepspeed is not None and isinstance(strategy, deepspeed):
        return _REFUSED, f"{name} writes a folder of files a rank, which warden's tier does not take"
    whole = tuple(
        k
        for k in (
            getattr(_pl.strategies, "SingleDeviceStrategy", None),
            getattr(_pl.strategies, "DDPStrategy", None),
        )
        if k is not None
    )
    if whole and isinstance(strategy, whole):
        return _WHOLE, None
    return _FILES, None


class WardenCallback(_pl.Callback):
    """Reports steps and sections to the agent, and saves checkpoints into its tier.

    ``every_n_steps``: save a checkpoint every that many optimizer steps
    (None: never; steps and sections only). ``client``: an explicit
    ``warden.connect(...)`` client (default: the module-level one).
    ``async_save``: save in the background where the strategy allows
    (default True; see the module's notes).
    """

    def __init__(
        self, every_n_steps: Optional[int] = None, client: Any = None, async_save: bool = True
    ) -> None:
        super().__init__()
        self.async_save = bool(async_save)
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, not {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._client = client
        self._tracker: Optional[StepTracker] = None
        #: The last step saved into the tier (None: none yet by this callback).
        self.last_saved: Optional[int] = None
        #: The step saved on a notice of a coming stop (None: no notice yet).
        self.preempted: Optional[int] = None
        self._prepared = False
        self._steps_seen = 0

    @property
    def _steps(self) -> StepTracker:
        if self._tracker is None:
            self._tracker = StepTracker(self._client)
        return self._tracker

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """A micro-batch starts: its optimizer step begins if not open yet; forward."""
        steps = self._steps
        if steps.step != trainer.global_step:
            steps.begin(trainer.global_step)
            if _healing(trainer):
                _HEAL.step_begins(trainer.global_step)
        steps.enter("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """The loss is computed: backward."""
        self._steps.enter("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        """Gradients are in: the section closes."""
        self._steps.leave()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """The optimizer steps (after its closure ran forward and backward)."""
        self._steps.enter("optimizer")
        if _healing(trainer):
            _HEAL.begin_update()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """The micro-batch is done; once the optimizer stepped, so is the step,
        and a checkpoint is due every ``every_n_steps``."""
        steps = self._steps
        steps.leave()
        if steps.step is None or trainer.global_step == steps.step:
            return  # gradient accumulation: the optimizer step is still to come
        steps.end()
        step = trainer.global_step
        if _healing(trainer):
            # The state in memory is that of `step` steps (a restart that
            # arrived during the update is raised here, the step done).
            _HEAL.commit(trainer)
        if not self._prepared:
            self._prepare_when_ready(trainer)
        # A notice of a coming stop: every rank saves the step the agent
        # named, then the fit stops and on_train_end leaves with 85.
        n = _notice()
        if n is not None and n.due(step) and self.preempted is None:
            if step != self.last_saved:
                self.save(trainer, step)
            self.preempted = step
            trainer.should_stop = True
            return
        if self.every_n_steps and step % self.every_n_steps == 0 and step != self.last_saved:
            self.save(trainer, step)

    def save(self, trainer: Any, step: int) -> Optional[str]:
        """Saves the Trainer's full checkpoint as this rank's shard of ``step``
        (every rank must call it: ``trainer.save_checkpoint`` has a barrier).
        Returns the shard's path ("async" for a save whose snapshot is taken
        and whose commit follows in the background, "sharded" for a sharded
        save committed through DCP), or None when the save failed or cannot
        be made (warned: a strategy that writes a folder)."""
        route, why = _route(trainer)
        if route == _REFUSED:
            # On every rank alike, so no rank waits in a collective for
            # another's save.
            warnings.warn(f"warden: checkpoint of step {step} not saved: {why}", stacklevel=2)
            return None
        if route == _SHARDED:
            with _section("checkpoint"):
                if not _sharded.save(trainer, step, self.async_save):
                    return None
            self.last_saved = step
            return "async" if self.async_save else "sharded"
        if self.async_save and route == _WHOLE:
            return self._save_async(trainer, step)
        done: Optional[str] = None
        with _section("checkpoint"):
            try:
                done = _ckpt.save_file(
                    step, lambda p: _write(trainer, p), size_hint=_checkpoint_size(trainer)
                )
            except _ckpt.CheckpointError as e:
                warnings.warn(f"warden: checkpoint of step {step} not saved: {e}", stacklevel=2)
        if done is not None:
            self.last_saved = step
        return done

    def _prepare_when_ready(self, trainer: Any) -> None:
        """Once the optimizers' state is made (``optimizer_state_made``; by the
        ``PREPARE_BY``-th step in any case: an optimizer without state, a
        parameter that never gets a gradient), the save buffer made ahead."""
        if not (self.every_n_steps and self.async_save):
            self._prepared = True  # nothing to make ahead
            return
        from ..async_checkpoint import prepare_once_ready  # noqa: PLC0415

        self._steps_seen += 1
        self._prepared = prepare_once_ready(
            self._steps_seen, trainer.optimizers, lambda: self._prepare_async(trainer)
        )

    def _prepare_async(self, trainer: Any) -> None:
        """The async saver's buffer made ahead on a thread of its own
        (``AsyncCheckpointer.prepare``; a sharded save's staging buffer,
        ``StagingPool.prepare``), sized from the module's and the
        optimizers' state dictionaries, which are the checkpoint's tensors:
        otherwise the first periodic save after every start touches the
        buffer's pages on the training thread. Only where periodic async
        saves are due (``_prepare_when_ready`` asks only then), on the ranks
        that write them; a save that comes first waits for the buffer
        (stall, as the faults would have been)."""
        if 0 < trainer.max_steps < self.every_n_steps:
            return  # no periodic save is due in this fit
        route = _route(trainer)[0]
        if route == _SHARDED:
            _sharded.prepare(trainer)
            return
        if route != _WHOLE or not trainer.is_global_zero:
            return
        state = {
            "state_dict": trainer.lightning_module.state_dict(),
            "optimizer_states": [o.state_dict() for o in trainer.optimizers],
        }
        _async_saver().prepare(state)

    def _save_async(self, trainer: Any, step: int) -> Optional[str]:
        """Lightning's checkpoint dictionary (built on every rank, as
        ``trainer.save_checkpoint`` does) snapshotted into the process's
        async saver on global rank 0; an empty state on the others, so the
        step is complete. Returns "async" once the snapshot is taken (the
        commit follows in the background), None when it failed (warned)."""
        saver = _async_saver()
        with _section("checkpoint"):
            state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            if not trainer.is_global_zero:
                state = {}
            for attempt in (0, 1):
                try:
                    saver.save(step, state)
                    break
                except _ckpt.CheckpointError as e:
                    # An earlier save failed in the background (never
                    # committed): said, and this one tried once more.
                    warnings.warn(f"warden: {e}", stacklevel=2)
                    if attempt == 1:
                        return None
        self.last_saved = step
        return "async"

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Refuses, before the first step, periodic saves that the strategy
        would write as a folder (each save would otherwise be warned and
        skipped)."""
        if self.every_n_steps:
            route, why = _route(trainer)
            if route == _REFUSED:
                raise ValueError(f"warden: WardenCallback(every_n_steps={self.every_n_steps}): {why}")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Keeps warden's stack-dump signal out of Lightning's restore of
        signal handlers; a healed fit resumed mid-epoch: the loaders skip
        what the epoch consumed."""
        _keep_stack_dump_handler(trainer)
        if _healing(trainer):
            _HEAL.position_data(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Closes what is open (a restart or an error ended the step)."""
        if self._tracker is not None:
            self._tracker.abandon()
        if _healing(trainer):
            _HEAL.fit_ended()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Nothing stays open after fit; after a save on a notice, the rank
        leaves with ``warden.Preempted`` (exit 85: "requeue me")."""
        if self._tracker is not None:
            self._tracker.end()
        if _healing(trainer):
            _HEAL.fit_ended()
        # The last saves committed before fit returns (and before leaving on
        # a notice: the step it saved must be in the tier).
        _wait_for_saves()
        if self.preempted is not None:
            raise _Preempted(self.preempted)


def _checkpoint_size(trainer: Any) -> int:
    """The most bytes ``trainer.save_checkpoint`` should write: the module's
    and the optimizers' tensors, 4 KiB per tensor for torch.save's entries,
    and 16 MiB for the rest (loops, callbacks, hyper-parameters). The agent
    cuts a staging file written past its declared size."""
    import torch  # noqa: PLC0415

    state = {
        "model": trainer.lightning_module.state_dict(),
        "optimizers": [o.state_dict() for o in getattr(trainer, "optimizers", [])],
    }
    nbytes, count = _ckpt._tensor_bytes(state, torch)
    return nbytes + 4096 * count + (16 << 20)


def _write(trainer: Any, path: str) -> None:
    """``trainer.save_checkpoint`` into the tier's staging file; on the ranks
    where Lightning writes nothing (all but global rank 0), an empty shard."""
    trainer.save_checkpoint(path)
    if not os.path.exists(path):
        open(path, "wb").close()


class WardenDDPStrategy(_pl.strategies.DDPStrategy):
    """Lightning's ``DDPStrategy`` healed from a live replica (``warden.heal``).

    With a ``WardenCallback`` among the Trainer's callbacks, under
    ``warden.run`` and ``warden run``: each attempt's process group is made
    by ``warden.heal.init_process_group`` (a store of its own per attempt,
    which no rank's death takes down); at every fit, before DDP wraps the
    module, the ranks behind (a replacement, a survivor interrupted during
    its optimizer update) receive module, optimizers, LR schedulers and the
    fit loop's progress from the lowest live rank at the newest committed
    step, and the survivors keep theirs in memory; where no live rank holds
    it, the tier's newest checkpoint is restored (``restore_path``). Call
    ``trainer.fit`` without ``ckpt_path``.

    ``seed``: the RNGs of each step are seeded from (seed, rank, step)
    (``warden.heal.seed_step``), so a replacement draws what the lost rank
    would have. ``find_unused_parameters`` defaults to True: DDP rebuilds
    its gradient buckets after its first iteration, and a DDP made again
    after a heal would all-reduce in another layout, whose sums differ in
    the last bits; True keeps the first layout, so a healed run ends with
    the weights of a fault-free one, bit for bit. The other keywords are
    ``DDPStrategy``'s.
    """

    def __init__(self, *args: Any, seed: int = 0, find_unused_parameters: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, find_unused_parameters=find_unused_parameters, **kwargs)
        self.warden_seed = int(seed)

    def setup_distributed(self) -> None:
        """This attempt's group on a store of its own; Lightning then finds
        it made and only sets its ranks."""
        import warden.heal  # noqa: PLC0415

        backend = self._process_group_backend or _default_backend(self.root_device)
        timeout = self._timeout.total_seconds() if self._timeout is not None else 600.0
        warden.heal.init_process_group(backend, timeout_s=timeout)
        super().setup_distributed()

    def setup(self, trainer: Any) -> None:
        """The heal before DDP wraps the module (its constructor broadcasts
        rank 0's weights), Lightning's restore of the rest after the fit's
        optimizers exist."""
        fitting = str(getattr(trainer.state.fn, "value", trainer.state.fn)) == "fit"
        if fitting:
            if not any(isinstance(c, WardenCallback) for c in trainer.callbacks):
                raise ValueError("warden: WardenDDPStrategy heals only with a WardenCallback in the Trainer's callbacks")
            _HEAL.before_ddp(trainer, self.lightning_module, self.warden_seed, restore_path)
        super().setup(trainer)
        if fitting:
            _HEAL.after_setup(trainer)


_ModelParallel = getattr(_pl.strategies, "ModelParallelStrategy", None)

if _ModelParallel is not None:

    class WardenModelParallelStrategy(_ModelParallel):  # type: ignore[misc,valid-type]
        """Lightning's ``ModelParallelStrategy`` (its arguments) whose sharded
        checkpoint, the default (``save_distributed_checkpoint=True``), goes
        into warden's tier: with a ``WardenCallback``, each save is one DCP
        save through ``WardenStorageWriter`` (in the background by default:
        the step holds for the copy of each rank's shards), each rank's
        shards one shard of the step; ``restore_path`` names the step
        (``warden:N``) and ``fit(ckpt_path=...)`` loads each rank's shards
        through ``WardenStorageReader``. Any other ``ckpt_path`` is
        Lightning's own load.

        ``heal=True`` (with a ``WardenCallback``, under ``warden.run`` and
        ``warden run``): FSDP2 with replica groups (HSDP: ``fully_shard``
        over the whole 2-D mesh, replicas over "data_parallel", shards over
        "tensor_parallel") heals from a live replica. Each attempt's group
        is made by ``warden.heal.init_process_group``; once Lightning
        sharded the module and made the fit's optimizers, a rank behind
        receives its shards of module and optimizers, the schedulers and
        the fit loop's progress from a live rank of the same shard position
        (``warden.heal_layout``), and the survivors keep theirs; where no
        live rank holds a shard position, every rank restores the tier's
        newest sharded checkpoint. Make the module once per process and
        ``configure_model`` do nothing once it is sharded; call
        ``trainer.fit`` without ``ckpt_path``. ``seed``: as
        ``WardenDDPStrategy``'s."""

        def __init__(self, *args: Any, heal: bool = False, seed: int = 0, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.warden_heal = bool(heal)
            self.warden_seed = int(seed)

        def _setup_distributed(self) -> None:
            """With ``heal``: this attempt's group on a store of its own;
            Lightning then finds it made and only sets its ranks."""
            if self.warden_heal:
                import warden.heal  # noqa: PLC0415

                backend = self._process_group_backend or _default_backend(self.root_device)
                timeout = self._timeout.total_seconds() if self._timeout is not None else 600.0
                warden.heal.init_process_group(backend, timeout_s=timeout)
            super()._setup_distributed()

        def setup(self, trainer: Any) -> None:
            """With ``heal``: the heal once the module is sharded and the
            fit's optimizers exist."""
            super().setup(trainer)
            fitting = str(getattr(trainer.state.fn, "value", trainer.state.fn)) == "fit"
            if self.warden_heal and fitting:
                if not any(isinstance(c, WardenCallback) for c in trainer.callbacks):
                    raise ValueError(
                        "warden: WardenModelParallelStrategy(heal=True) heals only with a WardenCallback in the "
                        "Trainer's callbacks"
                    )
                _HEAL.after_sharded_setup(trainer, self.lightning_module, self.warden_seed, restore_path)

        #: Set by warden's own save while it builds the checkpoint: the
        #: state dictionaries as references to the shards (no copy), where
        #: Lightning's offload to the CPU copies each tensor once more
        #: before warden's staging copies it again (or, on a GPU, copies it
        #: into pageable memory, not the pinned staging buffer).
        warden_references = False

        def lightning_module_state_dict(self) -> dict:
            if not self.warden_references:
                return super().lightning_module_state_dict()
            from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
                StateDictOptions,
                get_model_state_dict,
            )

            return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=False))

        def optimizer_state(self, optimizer: Any) -> dict:
            if not self.warden_references:
                return super().optimizer_state(optimizer)
            from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
                StateDictOptions,
                get_optimizer_state_dict,
            )

            optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
            return get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(cpu_offload=False))

        def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict:
            from . import dcp as _dcp  # noqa: PLC0415

            step = _dcp._step_of(str(checkpoint_path))
            if step is None:
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            # Each rank named its step before the process group existed
            # (``restore_path`` before ``fit``): the ranks agree on one now.
            agreed = _agree.agree(_ckpt.restore, _ckpt.CheckpointError, None, first=step)
            if agreed is not None:
                step = agreed.step
            return _sharded.load(self, step, _lightning_safe_globals())

else:  # pragma: no cover - a Lightning without ModelParallelStrategy
    WardenModelParallelStrategy = None  # type: ignore[assignment,misc]


def _keep_stack_dump_handler(trainer: Any) -> None:
    """Lightning's signal connector records every signal's Python-level
    handler when the fit starts and sets them all back at its teardown.
    The stack-dump handler (SIGUSR2) is faulthandler's, installed in C, which
    Python sees as SIG_DFL: set back, the next dump request would kill the
    rank (seen: a survivor waiting in a heal, asked for its stacks, died of
    SIGUSR2). Dropped from the record (``trainer._signal_connector``, a
    private attribute of Lightning 2.6.6), it is left alone."""
    from .._stackdump import _wanted_signal  # noqa: PLC0415

    handlers = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
    sig = _wanted_signal()
    if isinstance(handlers, dict) and sig:
        for key in [k for k in handlers if int(k) == sig]:
            del handlers[key]


def _default_backend(device: Any) -> str:
    return "nccl" if getattr(device, "type", "cpu") == "cuda" else "gloo"


def _healing(trainer: Any) -> bool:
    strategy = getattr(trainer, "strategy", None)
    return isinstance(strategy, WardenDDPStrategy) or bool(getattr(strategy, "warden_heal", False))
