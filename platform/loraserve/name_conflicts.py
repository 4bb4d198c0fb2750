"""409s of the adapter lifecycle: names no adapter or route may take, versions a route still needs.

Resolution tries the base model id first (loraserve.resolution.resolve), so an adapter or route named
like the base model could never be reached and `/v1/models` would list the name twice. A route may
share an adapter's name on purpose (it takes over the name; `name@version` still reaches the adapter).
"""

from __future__ import annotations

from loraserve.errors import Conflict


class NameConflict(Conflict):
    code = "name_conflict"


class AdapterInUse(Conflict):
    code = "adapter_in_use"


def check_not_base_model(name: str, base_model_id: str, what: str) -> None:
    """NameConflict if `name` is the served base model's id (what requests name to reach the base)."""
    if name == base_model_id:
        raise NameConflict(
            f"{what} name {name!r} is the id of the served base model, which requests naming it always "
            f"reach; pick another name",
            param="name",
        )


def refuse_breaking_routes(ref: str, broken: list[tuple[str, str]]) -> None:
    """AdapterInUse naming every route (and variant) that deleting `ref` would leave pointing at nothing."""
    if not broken:
        return
    uses = ", ".join(f"route {route!r} (variant {variant!r})" for route, variant in broken)
    first = broken[0][0]
    raise AdapterInUse(
        f"adapter {ref!r} is used by {uses}; point the route at another adapter "
        f"(PUT /v1/routes/{first}) or delete it (DELETE /v1/routes/{first}) first"
    )
