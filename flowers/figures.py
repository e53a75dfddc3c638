"""Pictures for TensorBoard drawn with PIL: a confusion matrix and a captioned grid of predictions.

PIL rather than matplotlib keeps plotting out of the training dependencies and is fast enough
to run every validation epoch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image, ImageDraw, ImageFont
from torchvision.transforms.functional import pil_to_tensor, to_pil_image

from flowers.data.transforms import TUTORIAL_MEAN, TUTORIAL_STD

CELL = 44  # confusion-matrix cell side, pixels
TILE = 128  # prediction-grid tile side, pixels
RIGHT, WRONG = (40, 160, 60), (200, 40, 40)


def _font(size: int = 12) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow built without FreeType has one bitmap size only
        return ImageFont.load_default()


def confusion_matrix_image(matrix: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    """Rows are true classes, columns predicted; shade is the row-normalised rate, text the count."""
    counts = matrix.detach().cpu().long()
    rates = counts.float() / counts.sum(dim=1, keepdim=True).clamp(min=1)
    font = _font()
    label_w = 8 + max(int(font.getlength(n)) for n in names)
    n = len(names)
    image = Image.new("RGB", (label_w + n * CELL + 8, label_w + n * CELL + 8), "white")
    draw = ImageDraw.Draw(image)
    for i, name in enumerate(names):
        draw.text((4, label_w + i * CELL + CELL // 2), name, fill="black", font=font, anchor="lm")
        # PIL cannot draw rotated text: draw the column label on a strip and rotate the strip.
        column = Image.new("RGB", (label_w, CELL), "white")
        ImageDraw.Draw(column).text((label_w - 4, CELL // 2), name, fill="black", font=font, anchor="rm")
        image.paste(column.rotate(90, expand=True), (label_w + i * CELL, 0))
        for j in range(n):
            shade = int(255 * (1 - float(rates[i, j])))
            box = (label_w + j * CELL, label_w + i * CELL, label_w + (j + 1) * CELL - 1, label_w + (i + 1) * CELL - 1)
            draw.rectangle(box, fill=(shade, shade, 255), outline=(200, 200, 200))
            text_colour = "white" if shade < 128 else "black"
            centre = (box[0] + CELL // 2, box[1] + CELL // 2)
            draw.text(centre, str(int(counts[i, j])), fill=text_colour, font=font, anchor="mm")
    return pil_to_tensor(image)


def prediction_grid(
    images: torch.Tensor, labels: torch.Tensor, probs: torch.Tensor, names: Sequence[str], *, columns: int = 4,
    mean: Sequence[float] = TUTORIAL_MEAN, std: Sequence[float] = TUTORIAL_STD,
) -> torch.Tensor:
    """Normalised images with a caption each: true class, predicted class and its probability (green if right)."""
    font = _font(11)
    caption_h = 30
    rows = (len(images) + columns - 1) // columns
    sheet = Image.new("RGB", (columns * TILE, rows * (TILE + caption_h)), "white")
    draw = ImageDraw.Draw(sheet)
    pixels = images.detach().cpu().float() * torch.tensor(std).view(3, 1, 1) + torch.tensor(mean).view(3, 1, 1)
    confidence, predicted = probs.detach().cpu().max(dim=1)
    for k, (image, label) in enumerate(zip(pixels, labels.tolist(), strict=True)):
        x, y = (k % columns) * TILE, (k // columns) * (TILE + caption_h)
        sheet.paste(to_pil_image(image.clamp(0, 1)).resize((TILE, TILE)), (x, y))
        pred = int(predicted[k])
        colour = RIGHT if pred == label else WRONG
        draw.text((x + 3, y + TILE + 2), f"true {names[label]}", fill="black", font=font)
        draw.text((x + 3, y + TILE + 15), f"pred {names[pred]} {float(confidence[k]):.2f}", fill=colour, font=font)
    return pil_to_tensor(sheet)
