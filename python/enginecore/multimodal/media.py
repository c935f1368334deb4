"""Images from users: PIL images, encoded bytes, ``data:`` URLs and (only for
hosts the operator allows, vLLM's ``--allowed-media-domains``) http(s) URLs.

Every failure is a ``ValueError`` naming the problem: an unsupported MIME type,
bytes that are no image, an image over the pixel cap (checked from the header,
before any pixel is decoded: a 30,000 x 30,000 PNG is a few KB that would
decode to 2.7 GB), a URL that is too slow or too large, a host not allowed.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass, field
from typing import Any

# The image types a chat may carry (what PIL decodes and vLLM accepts).
IMAGE_MIME_TYPES = frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp",
                              "image/gif", "image/bmp", "image/tiff"})
_PIL_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "MPO"})


@dataclass(frozen=True)
class MediaLimits:
    max_image_pixels: int = 64 << 20
    max_bytes: int = 20 << 20
    fetch_timeout_s: float = 5.0
    allowed_domains: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_config(cls, mm: Any) -> MediaLimits:
        """From a config.MultiModalConfig."""
        return cls(mm.max_image_pixels, mm.media_max_bytes, mm.media_fetch_timeout_s,
                   tuple(d.lower() for d in mm.allowed_media_domains))


def image_from_bytes(data: bytes, limits: MediaLimits) -> Any:
    """The RGB PIL image ``data`` encodes; ValueError for a corrupt or too large one."""
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise ValueError(f"image of {len(data)} bytes is over the limit of {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            # PIL warns, then raises, past its own bomb limit: our cap decides first.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ValueError(f"image is too large: {e} (limit {limits.max_image_pixels} pixels)"
                         ) from None
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for bad bytes
        raise ValueError(f"cannot decode the image: {type(e).__name__}: {e}") from None
    if image.format not in _PIL_FORMATS:
        raise ValueError(f"unsupported image format {image.format!r}; supported: "
                         f"{sorted(_PIL_FORMATS)}")
    return checked_image(image, limits)


def checked_image(image: Any, limits: MediaLimits) -> Any:
    """``image`` (a PIL image) decoded as RGB, after the pixel cap."""
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"image has no pixels ({width} x {height})")
    if width * height > limits.max_image_pixels:
        raise ValueError(f"image of {width} x {height} = {width * height} pixels is over the "
                         f"limit of {limits.max_image_pixels} pixels")
    try:
        return image.convert("RGB")
    except Exception as e:  # noqa: BLE001 - a truncated file fails only when decoded
        raise ValueError(f"cannot decode the image: {type(e).__name__}: {e}") from None


def image_from_url(url: Any, limits: MediaLimits) -> Any:
    """The image a chat's ``image_url`` names: a ``data:`` URL, or http(s) from an
    allowed host."""
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url must be a non-empty string")
    if url.startswith("data:"):
        return image_from_bytes(_data_url_bytes(url), limits)
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"image URL scheme {parsed.scheme!r} is not supported: use a data: "
                         "URL (or http(s) from an allowed domain)")
    host = (parsed.hostname or "").lower()
    if not limits.allowed_domains:
        raise ValueError("image URLs other than data: URLs are not allowed on this server "
                         "(the operator allows hosts with --allowed-media-domains)")
    if host not in limits.allowed_domains:
        raise ValueError(f"image URL host {host!r} is not in the allowed media domains")
    return image_from_bytes(_fetch(url, limits), limits)


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ValueError("malformed data: URL (no comma)")
    mime, *params = header.split(";")
    mime = mime.strip().lower()
    if mime not in IMAGE_MIME_TYPES:
        raise ValueError(f"unsupported image MIME type {mime!r}; supported: "
                         f"{sorted(IMAGE_MIME_TYPES)}")
    if "base64" not in params:
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"malformed base64 in the image data: URL: {e}") from None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect could lead off the allowed hosts: refuse it."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("image URL redirects are not followed")


def _fetch(url: str, limits: MediaLimits) -> bytes:
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(url, timeout=limits.fetch_timeout_s) as response:
            mime = (response.headers.get_content_type() or "").lower()
            if mime not in IMAGE_MIME_TYPES:
                raise ValueError(f"unsupported image MIME type {mime!r} at {url}")
            data = response.read(limits.max_bytes + 1)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - timeouts, refused connections, HTTP errors
        raise ValueError(f"cannot fetch the image at {url}: {e}") from None
    if len(data) > limits.max_bytes:
        raise ValueError(f"image at {url} is over the limit of {limits.max_bytes} bytes")
    return data
