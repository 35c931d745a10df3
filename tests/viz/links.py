"""Which kernel-side controls a viewer links to its view's selection traits."""

from __future__ import annotations


def kernel_links(viewer) -> dict[str, tuple[object, str]]:
    """``{view trait: (control, control trait)}`` of every link of ``viewer``."""
    links = {}
    for link in viewer._links:
        (source, source_trait), (target, target_trait) = link.source, link.target
        assert target is viewer.view
        links[target_trait] = (source, source_trait)
    return links
