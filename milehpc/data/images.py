"""Images in prompts: what a prompt file holds -> image parts in chat messages + image references.

A prompt with images reads as verl's and slime's prepared datasets write it: chat messages whose text holds an
``<image>`` marker per image and an ``images`` column (a list of raw bytes, file paths, or ``{"bytes", "path"}``
structs as ``datasets.Image`` stores them); or messages whose content is a list of parts
``{"type": "image", "image": <path or bytes>}`` / ``{"type": "text", "text": ...}``. Either becomes messages with
``{"type": "image"}`` parts (what a Qwen-VL chat template renders) plus the image bytes, in order.

A sample carries its images as **references** (``sha256:<hex>`` of the encoded bytes) in
``Sample.metadata["images"]``: rollout dumps and checkpoints store the references, never the pixels. The bytes stay
in this process's registry, filled when the prompt files are read: a rollout rank as it builds its prompt source,
a trainer rank (which builds none) by :func:`milehpc.data.source.register_images`, a resumed run as it starts again.

Login-safe: stdlib only (Pillow is imported when pixels are needed, on the ranks).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Any

from milehpc.errors import ConfigError

IMAGES_KEY = "images"  # the metadata key (and verl's column) holding a prompt's images
MARKER = "<image>"  # verl's placeholder for one image in a message's text
# The encoded images of the prompt files: the only copy in this process (not a cache, nothing to re-read them from
# by reference: a reference is a content hash). Their size is the files' images as stored (PNG/JPEG).
_REGISTRY: dict[str, bytes] = {}
# Processed pixels take ~100x their encoded bytes (fp32 patch rows): a byte budget, least recently used out first.
PIXEL_CACHE_BYTES = 256 << 20


class ByteLRU:
    """A least-recently-used map of tensors (or tuples of them) whose total ``nbytes`` stays within ``budget``; an
    entry larger than the budget alone is not kept."""

    def __init__(self, budget: int) -> None:
        self.budget, self.bytes = budget, 0
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> Any:
        hit = self._items.get(key)
        if hit is None:
            return None
        self._items.move_to_end(key)
        return hit[0]

    def put(self, key: str, value: Any) -> None:
        size = sum(int(t.nbytes) for t in (value if isinstance(value, tuple) else (value,)))
        if size > self.budget or key in self._items:
            return
        while self.bytes + size > self.budget:
            self.bytes -= self._items.popitem(last=False)[1][1]
        self._items[key] = (value, size)
        self.bytes += size


_PIXELS = ByteLRU(PIXEL_CACHE_BYTES)  # image reference -> (patch rows, grid (t, h, w))


def reference(data: bytes) -> str:
    """The reference of an encoded image: its content hash (the same image read twice is one reference)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def register(data: bytes) -> str:
    """Keep ``data`` in this process; returns its reference."""
    ref = reference(data)
    _REGISTRY.setdefault(ref, data)
    return ref


def image_bytes(ref: str) -> bytes:
    """The encoded image of ``ref`` (read into this process with the prompts)."""
    data = _REGISTRY.get(ref)
    if data is None:
        raise KeyError(f"image {ref} was not read in this process: its prompt file is not data.source or "
                       "data.val_source")
    return data


def load_image(ref: str) -> Any:
    """``ref`` as an RGB PIL image."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(image_bytes(ref))) as im:
        return im.convert("RGB")


def prompt_images(prompts: list[Any]) -> list[list[str]] | None:
    """The image references each prompt shows (``SamplingParams.images``), or None when no prompt has any."""
    if not any(p.metadata.get(IMAGES_KEY) for p in prompts):
        return None
    return [list(p.metadata.get(IMAGES_KEY) or []) for p in prompts]


def _image_data(item: Any, base: Path, where: str, file: str) -> bytes:
    """Encoded bytes of one image entry: raw bytes, a path (relative to the prompt file's folder), or a
    ``{"bytes", "path"}`` struct (``datasets.Image``)."""
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path") or item.get("image")
    if isinstance(item, bytes | bytearray):
        return bytes(item)
    if isinstance(item, str):
        path = Path(item) if os.path.isabs(item) else base / item
        try:
            return path.read_bytes()
        except OSError as err:
            raise ConfigError(f"{where}: cannot read image {item!r} ({err.strerror})", file=file,
                              field="data.source") from None
    raise ConfigError(f"{where}: expected an image as bytes, a path or {{bytes, path}}, got {type(item).__name__}",
                      file=file, field="data.source")


def _decodable(data: bytes, item: Any, where: str, file: str) -> bytes:
    """``data`` if Pillow recognises it as an image: checked here by its header, where the row is known (the pixels
    are decoded on the ranks when a forward needs them, where a bad file would be a traceback naming no row)."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)):
            return data
    except OSError:  # PIL.UnidentifiedImageError, a truncated header
        name = f" {item!r}" if isinstance(item, str) else ""
        raise ConfigError(f"{where}: expected an encoded image (PNG, JPEG, ...), got{name} {len(data)} bytes that "
                          "Pillow cannot read", file=file, field="data.source") from None


def has_images(row: dict[str, Any], prompt: Any) -> bool:
    """Whether a row's prompt has images (an ``images`` column, or image parts in its messages)."""
    if row.get(IMAGES_KEY):
        return True
    return isinstance(prompt, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                            for m in prompt)


def split_images(prompt: Any, column: Any, *, where: str, file: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(messages with ``{"type": "image"}`` parts, the images' references in order) of one row; every mismatch
    (markers vs images, a part of an unknown type) is one error naming the row."""
    base = Path(file).parent
    pool = list(column or [])
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list):
        raise ConfigError(f"{where}: expected chat messages with an images column, got {type(prompt).__name__}",
                          file=file, field="data.prompt_key")
    messages, refs, used = [], [], 0
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ConfigError(f"{where}: expected messages {{role, content}}, got {m!r}"[:160], file=file,
                              field="data.prompt_key")
        content = m.get("content")
        parts: list[dict[str, Any]] = []
        if isinstance(content, str):
            pieces = content.split(MARKER)
            for i, text in enumerate(pieces):
                if i:
                    parts.append({"type": "image"})
                if text:
                    parts.append({"type": "text", "text": text})
        elif isinstance(content, list):
            parts = [dict(p) for p in content]
        else:
            raise ConfigError(f"{where}: expected a message's content to be text or a list of parts, got "
                              f"{type(content).__name__}", file=file, field="data.prompt_key")
        for p in parts:
            kind = p.get("type")
            if kind == "image":
                inline = p.pop("image", None)
                if inline is None:
                    if used >= len(pool):
                        raise ConfigError(f"{where}: the prompt has more image places than the {len(pool)} images "
                                          f"of its '{IMAGES_KEY}' column", file=file, field="data.source")
                    inline, used = pool[used], used + 1
                refs.append(register(_decodable(_image_data(inline, base, where, file), inline, where, file)))
            elif kind != "text" or not isinstance(p.get("text"), str):
                raise ConfigError(f"{where}: expected message parts {{type: image}} or {{type: text, text}}, got "
                                  f"{p!r}"[:160], file=file, field="data.prompt_key")
        messages.append({"role": m["role"], "content": parts})
    if used < len(pool):
        raise ConfigError(f"{where}: the '{IMAGES_KEY}' column has {len(pool)} images, the prompt places {used} "
                          f"(one '{MARKER}' or {{type: image}} part each)", file=file, field="data.source")
    return messages, refs


# ---- through the model's processor (transformers, on the ranks) ----------------------------------------------

@lru_cache(maxsize=4)
def image_processor(folder: str) -> Any:
    """The folder's image processor on its PIL backend: the same pixels in every process, whichever backend
    transformers would pick there (torchvision's resize rounds differently)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder, backend="pil", local_files_only=True)


def tokenizer_folder(tokenizer: Any) -> str:
    """The folder an :class:`milehpc.data.tokenizer.HFTokenizer` was loaded from (its processor lives there)."""
    folder = getattr(getattr(tokenizer, "tok", None), "name_or_path", None)
    if not folder or not (Path(folder) / "processor_config.json").is_file():
        raise ConfigError(f"prompts with images need model.tokenizer = a model folder with a processor "
                          f"(processor_config.json), got {folder or 'toy'!r}", field="model.tokenizer")
    return str(folder)


def encode_prompt(tokenizer: Any, messages: list[dict[str, Any]], images: list[str]) -> tuple[list[int], str]:
    """(token ids, rendered text) of chat ``messages`` with image parts: the chat template renders one image
    placeholder token per image, widened here to as many as the image has merged patches (what the model's
    processor does; its video half would need torchvision, which a CPU rank hides while it imports the model)."""
    from milehpc.config.families import folder_config

    folder = tokenizer_folder(tokenizer)
    tok = tokenizer.tok
    text = str(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    placeholder = tok.convert_ids_to_tokens(int((folder_config(folder) or {})["image_token_id"]))
    pieces = text.split(placeholder)
    if len(pieces) - 1 != len(images):
        raise ConfigError(f"the chat template placed {len(pieces) - 1} images for a prompt with {len(images)}",
                          file=folder, field="model.tokenizer")
    widened = pieces[0] + "".join(placeholder * image_tokens(folder, ref) + piece
                                  for ref, piece in zip(images, pieces[1:], strict=True))
    return list(tok.encode(widened, add_special_tokens=False)), text


def image_tokens(folder: str, ref: str) -> int:
    """Placeholder tokens of image ``ref`` (its merged patches) by the image processor's own count from the image's
    size: reading the prompt files needs the images' headers, not their pixels (processed when a forward needs
    them)."""
    import io

    from PIL import Image

    proc = image_processor(folder)
    merge = int(proc.merge_size) ** 2
    if not getattr(proc, "do_resize", True):  # the count assumes the processor's resize: else the grid it makes
        return int(pixels(folder, ref)[1].prod()) // merge
    with Image.open(io.BytesIO(image_bytes(ref))) as im:
        width, height = im.size
    return int(proc.get_number_of_image_patches(height, width)) // merge


def pixels(folder: str, ref: str) -> tuple[Any, Any]:
    """(patch rows, grid (t, h, w)) of image ``ref`` by the image processor of ``folder`` (cached per reference
    within PIXEL_CACHE_BYTES: an image is processed again only after it has been evicted)."""
    hit = _PIXELS.get(ref)
    if hit is None:
        import torch

        out = image_processor(folder)(images=[load_image(ref)], return_tensors="pt")
        hit = (out["pixel_values"], out["image_grid_thw"][0].to(torch.long))
        _PIXELS.put(ref, hit)
    return hit


def rows_pixels(folder: str, images: list[list[str]]) -> list[list[tuple[Any, Any]]]:
    """:func:`pixels` of every row's images (what :func:`milehpc.models_vl.vision_inputs` takes)."""
    return [[pixels(folder, ref) for ref in row] for row in images]
