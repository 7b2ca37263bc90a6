"""An idempotent, revertible way to replace (or add) an attribute of a vLLM object."""

from typing import Any

# (owner, attribute name) -> original value; insertion-ordered so revert_all undoes in reverse.
_ORIGINALS: dict[tuple[Any, str], Any] = {}
_ABSENT = object()  # the original of an attribute the patch adds: reverting deletes it
# Every instance-level change made in this process, for the ledger test: (the instance's class, name).
_INSTANCE_CHANGES: set[tuple[type, str]] = set()


def patch(owner: Any, name: str, replacement: Any) -> None:
    """Set `owner.name = replacement`, remembering the original the first time only."""
    key = (owner, name)
    if key not in _ORIGINALS:
        _ORIGINALS[key] = owner.__dict__[name] if name in vars(owner) else getattr(owner, name, _ABSENT)
    setattr(owner, name, replacement)


def original(owner: Any, name: str) -> Any:
    """The value `owner.name` had before it was patched (or its current value if unpatched)."""
    return _ORIGINALS.get((owner, name), getattr(owner, name))


def applied_patches() -> list[str]:
    return [f"{getattr(owner, '__qualname__', None) or getattr(owner, '__name__', owner)}.{name}"
            for owner, name in _ORIGINALS]


def revert_all() -> None:
    """Restore every patched attribute (tests use this to prove patches are removable)."""
    for (owner, name), value in reversed(list(_ORIGINALS.items())):
        if value is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, value)
    _ORIGINALS.clear()


def swap(instance: Any, name: str, value: Any) -> None:
    """Set `instance.name = value` on one vLLM object (not its class), recorded for the ledger:
    every such change is listed in patches/README.md. `name` "__class__" swaps the object's class."""
    _INSTANCE_CHANGES.add((type(instance), name))  # (some are made per request: the names come later)
    setattr(instance, name, value)


def instance_changes() -> list[tuple[str, ...]]:
    """Each instance-level change as the names "Class.name" of the instance's class and its bases
    (the ledger lists it under one of them)."""
    names = {tuple(f"{c.__name__}.{name}" for c in cls.__mro__[:-1]) for cls, name in _INSTANCE_CHANGES}
    return sorted(names)
