"""Pull the inline PNGs out of static HTML and check they are real images."""

from __future__ import annotations

import base64
import re

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def inline_pngs(html: str) -> list[bytes]:
    """Every inline PNG of ``html``, decoded; asserts each one is a PNG of non-trivial size."""
    images = [base64.b64decode(m) for m in _IMG.findall(html)]
    for image in images:
        assert image.startswith(PNG_SIGNATURE)
        width, height = int.from_bytes(image[16:20], "big"), int.from_bytes(image[20:24], "big")
        assert width > 50 and height > 50
    return images
