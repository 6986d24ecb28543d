"""Video data: generated moving-shape clips (the CPU mini task) and a local folder of clips + captions.

Moving shapes (``data.name=moving_shapes``): sample ``i`` is a deterministic function of ``(seed, i)``: a
colored square or circle moving left/right/up/down on a dark canvas, ``num_frames`` frames of
``size x size`` pixels, in [-1, 1]. Its caption is ``"a <color> <shape> moving <direction>"`` and its
text is the token ids of those three words in a 10-word vocabulary (id 0 is the empty / null prompt).

Clip folder (``data.name=video_folder``, ``data.root=/path``):

    /path/metadata.jsonl      one JSON object per line: {"video": "clips/0001.mp4", "caption": "a dog ..."}
    /path/clips/0001.mp4      any format OpenCV reads; resized + centre-cropped to data.height x data.width,
                              the first data.num_frames frames (every data.frame_stride-th)

Text embeddings: with ``data.text_emb_dir`` set, ``<text_emb_dir>/<sha1(caption)>.pt`` holds the UMT5
embedding ``[L, 4096]`` of each caption (written by ``python -m tasks.video_gen.sample --encode-only`` or
by the training run on first use); without it the task encodes captions with the UMT5 encoder from
``model.pretrained``.
"""

from __future__ import annotations

import json
import os

import torch
from torch.utils.data import Dataset

from .media import read_video

COLORS = {"red": (1.0, -0.8, -0.8), "green": (-0.8, 0.9, -0.8), "blue": (-0.7, -0.5, 1.0), "yellow": (1.0, 1.0, -0.9)}
SHAPES = ("square", "circle")
DIRECTIONS = {"right": (0, 1), "left": (0, -1), "down": (1, 0), "up": (-1, 0)}
VOCAB = ("<null>", *COLORS, *SHAPES, *DIRECTIONS)
WORD_ID = {w: i for i, w in enumerate(VOCAB)}


def caption_ids(caption: str) -> torch.Tensor:
    """``"a red square moving right"`` -> LongTensor ``[3]`` of (color, shape, direction) word ids."""
    words = caption.split()
    try:
        return torch.tensor([WORD_ID[words[1]], WORD_ID[words[2]], WORD_ID[words[4]]])
    except (KeyError, IndexError):
        raise ValueError(f"caption {caption!r} is not 'a <color> <shape> moving <direction>' with color in "
                         f"{list(COLORS)}, shape in {list(SHAPES)}, direction in {list(DIRECTIONS)}") from None


def render_clip(color: str, shape: str, direction: str, *, num_frames: int = 8, size: int = 32,
                start=(0.5, 0.5), radius: float = 5.0, speed: float = 2.5, background: float = -0.8) -> torch.Tensor:
    """``[3, F, size, size]`` in [-1, 1]: the shape's centre moves ``speed`` px per frame from ``start``."""
    dy, dx = DIRECTIONS[direction]
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32) + 0.5,
                            torch.arange(size, dtype=torch.float32) + 0.5, indexing="ij")
    rgb = torch.tensor(COLORS[color]).view(3, 1, 1)
    out = torch.full((3, num_frames, size, size), background)
    for f in range(num_frames):
        cy, cx = start[0] * size + dy * speed * f, start[1] * size + dx * speed * f
        if shape == "square":
            mask = ((yy - cy).abs() <= radius) & ((xx - cx).abs() <= radius)
        else:
            mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= (radius + 0.5) ** 2
        out[:, f] = torch.where(mask, rgb, out[:, f])
    return out


class MovingShapes(Dataset):
    """``length`` generated clips; item ``i`` -> ``(video [3, F, S, S], text ids [3])``.

    The start position is drawn so the shape stays inside the canvas for all frames. Radius (3.5-5.5 px)
    and speed (1.5-3 px per frame) are those of a 32 px canvas, scaled by ``size / 32`` for other sizes.
    ``start="edge"``: the shape starts at the edge it moves away from (random across the motion), so the
    direction word fixes where the clip begins and ends; ``"random"``: anywhere its path fits.
    """

    def __init__(self, length: int, *, num_frames: int = 8, size: int = 32, seed: int = 0, start: str = "random"):
        if start not in ("random", "edge"):
            raise ValueError(f"start must be 'random' or 'edge', got {start!r}")
        self.length, self.num_frames, self.size, self.seed = int(length), int(num_frames), int(size), int(seed)
        self.start = start

    def __len__(self) -> int:
        return self.length

    def spec(self, index: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        r = lambda n: int(torch.randint(n, (1,), generator=g))  # noqa: E731
        color, shape, direction = list(COLORS)[r(4)], SHAPES[r(2)], list(DIRECTIONS)[r(4)]
        k = self.size / 32
        radius = (3.5 + float(torch.rand(1, generator=g)) * 2) * k
        speed = (1.5 + float(torch.rand(1, generator=g)) * 1.5) * k
        dy, dx = DIRECTIONS[direction]
        lo, hi = radius + 1, self.size - radius - 1
        speed = min(speed, (hi - lo) / max(self.num_frames - 1, 1))  # fast + large: slow down to stay inside
        travel = speed * (self.num_frames - 1)

        def start(d):
            a, b = (lo, hi - travel) if d > 0 else (lo + travel, hi) if d < 0 else (lo, hi)
            u = float(torch.rand(1, generator=g))  # drawn in both modes: the rest of the spec stays the same
            if self.start == "edge" and d:
                return (a if d > 0 else b) / self.size
            return (a + u * max(b - a, 0)) / self.size

        return dict(color=color, shape=shape, direction=direction, radius=radius, speed=speed,
                    start=(start(dy), start(dx)))

    def caption(self, index: int) -> str:
        s = self.spec(index)
        return f"a {s['color']} {s['shape']} moving {s['direction']}"

    def __getitem__(self, index: int):
        s = self.spec(index)
        video = render_clip(s["color"], s["shape"], s["direction"], num_frames=self.num_frames, size=self.size,
                            start=s["start"], radius=s["radius"], speed=s["speed"])
        return video, caption_ids(self.caption(index))


class VideoFolder(Dataset):
    """Clips listed in ``<root>/metadata.jsonl``; item -> ``(video [3, F, H, W] in [-1, 1], caption str)``."""

    def __init__(self, root: str, *, num_frames: int, height: int, width: int, frame_stride: int = 1,
                 limit: int | None = None):
        meta = os.path.join(root, "metadata.jsonl")
        if not os.path.isfile(meta):
            raise FileNotFoundError(
                f"{meta} not found: data.root must hold metadata.jsonl with one "
                f'{{"video": "clips/x.mp4", "caption": "..."}} per line (see tasks/video_gen/data.py)')
        with open(meta) as f:
            self.items = [json.loads(line) for line in f if line.strip()]
        if limit:
            self.items = self.items[: int(limit)]
        if not self.items:
            raise ValueError(f"{meta} lists no clips")
        self.root, self.num_frames, self.height, self.width = root, num_frames, height, width
        self.frame_stride = frame_stride

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        item = self.items[index]
        video = read_video(os.path.join(self.root, item["video"]), self.num_frames, self.height, self.width,
                           self.frame_stride)
        return video, item["caption"]
