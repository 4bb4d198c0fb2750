"""Config store errors: the API answers ConfigStoreUnavailable with 503, the rest with 500."""

from __future__ import annotations


class ConfigStoreError(Exception):
    """A record that cannot be decoded, or any other store failure that retrying will not fix."""


class ConfigStoreUnavailable(ConfigStoreError):
    """The backend cannot be reached (Redis down, disk unreadable); cached reads keep serving meanwhile."""


class AdapterBeingDeleted(Exception):
    """A route write waited for a deletion of an adapter it names, on another replica, and it did not end in
    time; the route service answers 409 (retry)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name
