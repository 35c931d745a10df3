"""Which selector traits a viewer links, in the browser, to its drawing area's traits."""

from __future__ import annotations


def browser_links(viewer) -> dict[str, tuple[object, str]]:
    """``{view trait: (selector, selector trait)}`` of every jslink of ``viewer``."""
    links = {}
    for link in viewer._links:
        (source, source_trait), (target, target_trait) = link.source, link.target
        assert target is viewer.view
        links[target_trait] = (source, source_trait)
    return links
