"""Images in chat messages: from OpenAI-style content parts to the engine's multimodal inputs.

A user message may mix text and image parts::

    {"role": "user", "content": [
        {"type": "text", "text": "What is in"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},   # or a local path
        {"type": "image", "image": <PIL.Image | path | data: URL>}]}

:func:`extract_images` loads every image part (in order) and leaves ``{"type": "image"}`` in its
place, which the model's chat template renders as its placeholder (``<|vision_start|>
<|image_pad|><|vision_end|>`` for Qwen3.5). :class:`ImageInputs` then runs the checkpoint's own
``transformers`` image processor on each image, expands the i-th ``<|image_pad|>`` to the image's
token count and describes it as a :class:`~lmdeploy.pytorch.multimodal.MultimodalInput` whose
content hash is taken over the processed pixels (so the same picture from a file or a data URL
is the same cache key).
"""
from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..pytorch.multimodal import MultimodalInput, tensor_content_hash

__all__ = ['IMAGE_PART_TYPES', 'load_image', 'extract_images', 'has_images', 'ImageInputs', 'ImageFetchLimits',
           'fetch_http_images', 'chat_part']

IMAGE_PART_TYPES = ('image', 'image_url')


def load_image(src: Any, where: str):
    """A PIL RGB image from a PIL image, a local file path or a ``data:`` URL (base64).

    Args:
        src: the image source.
        where: the part's location (e.g. ``messages[0].content[1]``) for error messages.

    Raises:
        ValueError: naming ``where``: an unsupported source (e.g. an http(s) URL, which only the
            api_server fetches), a missing file, bad base64 or bytes PIL cannot decode.
    """
    from PIL import Image
    if isinstance(src, Image.Image):
        return src.convert('RGB')
    if not isinstance(src, str) or not src:
        raise ValueError(f'{where}: an image must be a PIL image, a local path or a data: URL')
    try:
        if src.startswith('data:'):
            head, _, payload = src.partition(',')
            if ';base64' not in head:
                raise ValueError(f'{where}: a data: URL image must be base64-encoded')
            raw = base64.b64decode(payload, validate=True)
            return Image.open(io.BytesIO(raw)).convert('RGB')
        if src.startswith(('http://', 'https://')):
            raise ValueError(f'{where}: http(s) image URLs are not fetched here; pass a local path, a data: URL '
                             f'or a PIL image')
        path = src[len('file://'):] if src.startswith('file://') else src
        if not os.path.isfile(path):
            raise ValueError(f'{where}: image file {path!r} not found')
        with Image.open(path) as im:
            return im.convert('RGB')
    except (OSError, binascii.Error) as err:      # binascii.Error is a ValueError: caught first
        raise ValueError(f'{where}: cannot decode the image ({_reason(err)})') from err


def _reason(err: Exception) -> str:
    """A decoding error in words, without PIL's ``<_io.BytesIO object at 0x...>`` repr."""
    from PIL import UnidentifiedImageError
    if isinstance(err, UnidentifiedImageError):
        return 'not an image format PIL can read'
    if isinstance(err, binascii.Error):
        return f'invalid base64: {err}'
    return str(err)


def _image_source(part: dict, where: str):
    if part['type'] == 'image':
        if 'image' not in part:
            raise ValueError(f'{where}: an image part needs an "image" field')
        return part['image']
    ref = part.get('image_url')
    url = ref.get('url') if isinstance(ref, dict) else ref
    if not url:
        raise ValueError(f'{where}.image_url.url is missing')
    return url


def has_images(messages) -> bool:
    """Whether any message has an image content part."""
    return isinstance(messages, (list, tuple)) and any(
        isinstance(m, dict) and isinstance(m.get('content'), list)
        and any(isinstance(p, dict) and p.get('type') in IMAGE_PART_TYPES for p in m['content'])
        for m in messages)


def chat_part(i: int, j: int) -> str:
    """The chat-completions name of part ``j`` of message ``i``: ``messages[i].content[j]``."""
    return f'messages[{i}].content[{j}]'


def extract_images(messages: list[dict], where: Callable[[int, int], str] = chat_part) -> tuple[list[dict], list]:
    """Load the image parts of ``messages``.

    Args:
        where: the name of part ``j`` of message ``i`` in errors (a translated request names the
            client's own field).

    Returns:
        ``(messages with each image part replaced by {"type": "image"}, PIL images in order)``.

    Raises:
        ValueError: see :func:`load_image`, naming the part by ``where``.
    """
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get('content') if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get('type') in IMAGE_PART_TYPES:
                name = where(i, j)
                images.append(load_image(_image_source(p, name), name))
                parts.append({'type': 'image'})
            else:
                parts.append(p)
        out.append(dict(m, content=parts))
    return out, images


class ImageInputs:
    """The checkpoint's image processor and placeholder ids.

    Args:
        model_path: the checkpoint directory (with ``preprocessor_config.json``).
        hf_config: its ``transformers`` config (``image_token_id``, ``vision_config.spatial_merge_size``).

    Raises:
        ValueError: the checkpoint has no image processor.
    """

    def __init__(self, model_path: str, hf_config):
        from transformers import AutoImageProcessor
        try:
            self.processor = AutoImageProcessor.from_pretrained(model_path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(f'{model_path}: no image processor (preprocessor_config.json): {err}') from err
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(hf_config.vision_config.spatial_merge_size)

    def expand(self, ids: list[int], images: list,
               wheres: list[str] | None = None) -> tuple[list[int], tuple[MultimodalInput, ...]]:
        """Expand the i-th image token of ``ids`` to image i's token run.

        Returns:
            ``(token ids, one MultimodalInput per image)``; ``data`` holds ``pixel_values`` float
            ``[patches, C * tp * p * p]`` and ``image_grid_thw`` int64 ``[1, 3]``.

        Raises:
            ValueError: the rendered prompt has a different number of image placeholders than
                there are images (e.g. a chat template that drops image parts); the image
                processor refuses an image (e.g. an extreme aspect ratio), naming ``wheres[i]``
                (the image's part, e.g. ``messages[0].content[1]``) or else ``image i``.
        """
        slots = [k for k, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(f'the rendered prompt has {len(slots)} image placeholders for {len(images)} images '
                             f'(does the chat template render image parts?)')
        out, mms, prev = [], [], 0
        for n, (k, image) in enumerate(zip(slots, images)):
            try:
                data = dict(self.processor(images=[image], return_tensors='pt'))
            except ValueError as err:
                where = wheres[n] if wheres is not None and n < len(wheres) else f'image {n}'
                raise ValueError(f'{where}: {err}') from err
            px, grid = data['pixel_values'], data['image_grid_thw'].reshape(1, 3)
            n = int(grid.prod()) // self.merge ** 2
            out += ids[prev:k]
            mms.append(MultimodalInput(len(out), len(out) + n, tensor_content_hash(px, grid),
                                       {'pixel_values': px, 'image_grid_thw': grid}))
            out += [self.image_token_id] * n
            prev = k + 1
        return out + ids[prev:], tuple(mms)


@dataclass(frozen=True)
class ImageFetchLimits:
    """Limits on downloading an ``http(s)`` image (api_server only).

    Attributes:
        max_bytes: largest image body accepted (bytes).
        timeout_s: wall-clock limit for one download (seconds), connection included.
        allowed_domains: host names an image URL may name (lower case, exact match; redirects
            included); empty: any host.
        allow_private: also fetch from hosts that resolve to loopback, private, link-local or
            otherwise non-public addresses. Off by default, so that a client cannot make the
            server reach into its own network (checked on the host's addresses before connecting
            and on the address each connection reaches, redirects included).
    """
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0
    allowed_domains: tuple[str, ...] = ()
    allow_private: bool = False


class _RefusedURL(OSError):
    """An image URL the server's policy refuses (its message is the client's answer)."""


def _non_public(ip: str) -> bool:
    """True for an address a client-supplied URL must not reach: not globally routable
    (loopback, private, link-local, shared, reserved, unspecified) or multicast."""
    addr = ipaddress.ip_address(ip.split('%', 1)[0])
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return not addr.is_global or addr.is_multicast


_PRIVATE_REFUSED = ('image URLs may not point to loopback, private or link-local addresses (the server allows '
                    'this with --allow-private-media-urls)')


def _check_host(host: str | None, port: int | None, limits: ImageFetchLimits) -> None:
    """Refuse, before connecting, a host outside ``allowed_domains`` and (unless
    ``allow_private``) a host with any non-public address: the answer is the same whether or
    not anything listens there, so refusals reveal nothing about the server's network."""
    host = (host or '').lower().rstrip('.').strip('[]')
    if limits.allowed_domains and host not in limits.allowed_domains:
        raise _RefusedURL(f'image host {host!r} is not one of the allowed media domains')
    if not limits.allow_private:
        try:
            infos = socket.getaddrinfo(host, port or 80, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return                  # unresolvable: the connection attempt reports it
        if any(_non_public(info[4][0]) for info in infos):
            raise _RefusedURL(_PRIVATE_REFUSED)


def _guarded_opener(limits: ImageFetchLimits):
    """A ``urllib`` opener whose every connection (the first and each redirect) is checked:
    the host (:func:`_check_host`) before connecting, and the address the TCP connection reached
    (the name may resolve differently a moment later) before TLS or any request byte."""
    import http.client
    import urllib.request

    def create_connection(address, *args, **kwargs):
        sock = socket.create_connection(address, *args, **kwargs)
        if not limits.allow_private and _non_public(sock.getpeername()[0]):
            sock.close()
            raise _RefusedURL(_PRIVATE_REFUSED)
        return sock

    def checked(conn_class):
        class Checked(conn_class):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self._create_connection = create_connection      # http.client's connection hook

            def connect(self):
                _check_host(self.host, self.port, limits)
                super().connect()
        return Checked

    plain, tls = checked(http.client.HTTPConnection), checked(http.client.HTTPSConnection)

    class HTTP(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(plain, req)

    class HTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(tls, req, context=self._context)

    return urllib.request.build_opener(urllib.request.ProxyHandler({}), HTTP, HTTPS)


def _fetch(url: str, limits: ImageFetchLimits, where: str) -> bytes:
    import urllib.error
    import urllib.parse
    import urllib.request
    deadline = time.monotonic() + limits.timeout_s
    try:
        parts = urllib.parse.urlsplit(url)
        if '@' in parts.netloc:
            raise _RefusedURL('image URLs with a user name or password are not fetched')
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f'{where}: {url!r} has an invalid port') from None
        _check_host(parts.hostname, port, limits)
        with _guarded_opener(limits).open(urllib.request.Request(url, headers={'User-Agent': 'lmdeploy'}),
                                          timeout=limits.timeout_s) as resp:
            declared = resp.headers.get('Content-Length')
            if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
                raise ValueError(f'{where}: the image at {url!r} has {declared} bytes, over the limit of '
                                 f'{limits.max_bytes}')
            body = bytearray()
            while True:
                if time.monotonic() > deadline:
                    raise ValueError(f'{where}: fetching {url!r} took longer than {limits.timeout_s} s')
                piece = resp.read(1 << 16)
                if not piece:
                    return bytes(body)
                body += piece
                if len(body) > limits.max_bytes:
                    raise ValueError(f'{where}: the image at {url!r} is over the limit of {limits.max_bytes} bytes')
    except ValueError:
        raise
    except (OSError, urllib.error.URLError) as err:       # includes timeouts and HTTP errors
        refused = err if isinstance(err, _RefusedURL) else getattr(err, 'reason', None)
        if isinstance(refused, _RefusedURL):
            raise ValueError(f'{where}: {refused}') from None
        raise ValueError(f'{where}: cannot fetch {url!r} ({err})') from err


def fetch_http_images(messages: list[dict], limits: ImageFetchLimits,
                      where: Callable[[int, int], str] = chat_part) -> list[dict]:
    """``messages`` with every ``image_url`` part whose URL is ``http(s)`` replaced by an
    ``image`` part holding the downloaded picture (other parts unchanged).

    Args:
        where: the name of part ``j`` of message ``i`` in errors (as :func:`extract_images`).

    Raises:
        ValueError: naming the part by ``where``: an ``image_url`` that is neither a
            ``data:`` nor an ``http(s)`` URL (a local path or ``file://`` URL, which a remote
            client must not make the server read), or the download failed, ran past
            ``limits.timeout_s`` or past ``limits.max_bytes``, or is not an image.
    """
    from PIL import Image
    out = []
    for i, m in enumerate(messages):
        content = m.get('content')
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            url = p.get('image_url', {}).get('url', '') if p.get('type') == 'image_url' else ''
            name = where(i, j)
            scheme = url.partition(':')[0].lower()
            if p.get('type') == 'image_url' and not (url.startswith('data:') or scheme in ('http', 'https')):
                # a client must not make the server open its own files (a path or file:// URL)
                raise ValueError(f'{name}: an image_url must be a data: URL or an http(s) URL, got {url[:64]!r}')
            if scheme in ('http', 'https'):
                raw = _fetch(url, limits, name)
                try:
                    image = Image.open(io.BytesIO(raw)).convert('RGB')
                except OSError as err:
                    raise ValueError(f'{name}: {url!r} is not a readable image ({_reason(err)})') from err
                p = {'type': 'image', 'image': image}
            parts.append(p)
        out.append(dict(m, content=parts))
    return out
