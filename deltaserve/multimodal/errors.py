"""Errors for bad media and bad multimodal requests: every one is a ValueError subclass whose message names the
problem, so the API layer can answer 400 in vLLM's error envelope without inspecting the type."""

from __future__ import annotations


class MediaError(ValueError):
    """Base class: a media item or a multimodal request that deltaserve refuses (API: 400). `param` names the
    request field at fault in the API's dotted form ("messages.0.content"), when one part is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class MediaDecodeError(MediaError):
    """The bytes are not a decodable image or video (corrupt, truncated, unknown format)."""


class MediaTypeError(MediaError):
    """The declared MIME type or URL scheme does not fit the content part (e.g. text/plain in an image_url)."""


class MediaSizeError(MediaError):
    """Dimensions or frame counts past the configured limits, or an aspect ratio the processor cannot resize."""


class MediaPathError(MediaError):
    """A local file outside --allowed-local-media-path, a missing file, or local files not enabled at all."""


class MediaLimitError(MediaError):
    """More items of one modality than --limit-mm-per-prompt allows."""


class MediaRequestError(MediaError):
    """A malformed multimodal content part or a prompt whose placeholders do not match its media items."""
