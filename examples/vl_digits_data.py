"""Inputs of examples/vl_digits.toml: a tiny random Qwen2.5-VL model with its processor (built in code by
tests/vl_models.py, no downloads) and a generated visual task in verl's Parquet layout: "what digit is drawn?" over
16 x 16 images of one digit drawn with Pillow at a few offsets; the label is the digit.

    python examples/vl_digits_data.py OUT [FAMILY]   # writes OUT/model/ and OUT/digits.parquet; OUT = runs/vl-digits
                                                     # is where examples/vl_digits.toml looks (relative paths are
                                                     # read from where milehpc runs);
                                                     # FAMILY: qwen2_5_vl (default), qwen3_vl or qwen3_vl_moe
    milehpc run examples/vl_digits.toml --site local [--set model.path=OUT/model --set model.tokenizer=OUT/model \\
        --set data.source=OUT/digits.parquet]
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

OFFSETS = [(x, y) for x in (4, 6) for y in (1, 3)]  # where the 6 x 11 glyph sits in the 16 x 16 image
QUESTION = "<image>what digit is drawn?"


def digit_png(digit: int, offset: tuple[int, int]) -> bytes:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (16, 16), "white")
    ImageDraw.Draw(im).text(offset, str(digit), fill="black")  # Pillow's built-in bitmap font: no font files
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


def write_task(path: Path) -> Path:
    """Every digit at every offset, one row each (verl: prompt messages with an <image> marker, images column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": QUESTION}], "images": [{"bytes": digit_png(d, o), "path": None}],
             "reward_model": {"ground_truth": str(d)}, "data_source": "vl_digits"}
            for d in range(10) for o in OFFSETS]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def main(out: Path, family: str = "qwen2_5_vl") -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from vl_models import save_tiny_vl

    out.mkdir(parents=True, exist_ok=True)
    save_tiny_vl(out / "model", family=family)
    write_task(out / "digits.parquet")


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:3])
