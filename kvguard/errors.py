"""The error hierarchy of kvguard. Each message says what was wrong and what to do."""


class KVGuardError(Exception):
    """Base of every error kvguard raises on purpose."""


class ConfigError(KVGuardError, ValueError):
    """A configuration, policy or name is invalid."""


class InputError(KVGuardError, ValueError):
    """A caller passed a tensor of the wrong shape, dtype or device, or a bad argument."""


class UnknownSequence(KVGuardError, KeyError):
    """The sequence id is not open in this cache."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown sequence"


class OutOfPages(KVGuardError):
    """No free page is left for an operation that cannot wait (fetching pages back)."""


class TierError(KVGuardError):
    """A lower tier (disk, Redis) failed while its copies were being erased: what the
    operation had done is safe to do again, so retry it once the tier is back. Also a
    copy that does not open under its process's key (altered, or moved between keys)."""
