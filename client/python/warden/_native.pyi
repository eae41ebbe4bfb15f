"""Type stubs for the native module ``warden._native``."""

from os import PathLike
from types import TracebackType
from typing import Any, Callable, Optional, TypedDict, TypeVar, Union

_F = TypeVar("_F", bound=Callable[..., Any])

SLOT_LAYOUT_VERSION: int

class StepRecord(TypedDict):
    step: int
    start_ns: int
    duration_ns: int
    sections: dict[str, int]

class Snapshot(TypedDict):
    heartbeats: int
    step: int
    step_open: bool
    steps_completed: int
    depth: int
    misuse: int
    open_sections: list[tuple[str, int]]
    recent_steps: list[StepRecord]

class Status(TypedDict):
    connected: bool
    slot_index: Optional[int]
    generation: Optional[int]
    registrations: int
    last_error: Optional[str]

class Section:
    """A section resolved to its id; a context manager and a decorator."""

    @property
    def id(self) -> int: ...
    @property
    def name(self) -> str: ...
    def __enter__(self) -> None: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...
    def __call__(self, func: _F) -> _F: ...

class Step:
    """A training step as a context manager."""

    def __enter__(self) -> None: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class Client:
    """A connection to the local warden agent (or a private slot while none)."""

    def heartbeat(self) -> None: ...
    def step_begin(self, step: int) -> None: ...
    def step_end(self, step: int) -> None: ...
    def section(self, name: str) -> Section: ...
    def step(self, step: int) -> Step: ...
    def section_id(self, name: str) -> int: ...
    def section_open(self, id: int) -> None: ...
    def section_close(self, id: int) -> None: ...
    def is_connected(self) -> bool: ...
    def status(self) -> Status: ...
    def snapshot(self) -> Snapshot: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Client": ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

def connect(
    job_id: Optional[str] = None,
    global_rank: Optional[int] = None,
    local_rank: Optional[int] = None,
    world_size: Optional[int] = None,
    socket_path: Optional[Union[str, PathLike[str]]] = None,
    connect_timeout: Optional[float] = None,
) -> Client: ...
def default_client() -> Client: ...
def heartbeat() -> None: ...
def step_begin(step: int) -> None: ...
def step_end(step: int) -> None: ...
def section(name: str) -> Section: ...
def step(step: int) -> Step: ...
def is_connected() -> bool: ...
