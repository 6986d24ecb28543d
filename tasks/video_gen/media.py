"""Write videos: GIF (Pillow) and MP4 (OpenCV's mp4v), from ``[C, F, H, W]`` tensors in [-1, 1]."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """``[C, F, H, W]`` in [-1, 1] -> ``[F, H, W, 3]`` uint8 (1-channel video is repeated to RGB)."""
    v = ((video.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    if v.shape[0] == 1:
        v = v.repeat(3, 1, 1, 1)
    return v.permute(1, 2, 3, 0).cpu().numpy()


def tile_videos(videos: list[torch.Tensor], pad: int = 2) -> torch.Tensor:
    """Place ``[C, F, H, W]`` videos side by side (same C, F, H) with a ``pad``-pixel white gap."""
    c, f, h, _ = videos[0].shape
    gap = torch.ones(c, f, h, pad, dtype=videos[0].dtype, device=videos[0].device)
    parts = []
    for i, v in enumerate(videos):
        parts += ([gap] if i else []) + [v]
    return torch.cat(parts, dim=3)


def save_gif(video: torch.Tensor, path, fps: int = 8, scale: int = 1) -> Path:
    """Animated GIF of ``[C, F, H, W]`` (nearest upscaling by ``scale``, loops forever)."""
    frames = [Image.fromarray(f) for f in to_uint8_frames(video)]
    if scale != 1:
        frames = [f.resize((f.width * scale, f.height * scale), Image.NEAREST) for f in frames]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    return path


def save_mp4(video: torch.Tensor, path, fps: int = 16) -> Path | None:
    """MP4 (mp4v codec) through OpenCV; returns None when OpenCV cannot write one here."""
    try:
        import cv2  # noqa: PLC0415
    except ImportError:
        return None
    frames = to_uint8_frames(video)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    h, w = frames.shape[1:3]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
    if not writer.isOpened():
        return None
    for f in frames:
        writer.write(cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def save_frames_png(videos: list[torch.Tensor], path, scale: int = 1) -> Path:
    """One row per video ``[C, F, H, W]``, its frames left to right, as a PNG (to look at without a player)."""
    rows = [np.concatenate(list(to_uint8_frames(v)), axis=1) for v in videos]
    img = Image.fromarray(np.concatenate(rows, axis=0))
    if scale != 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def read_video(path, num_frames: int, height: int, width: int, stride: int = 1) -> torch.Tensor:
    """First ``num_frames`` frames (every ``stride``-th) of a video file, resized and centre-cropped.

    Returns ``[3, F, H, W]`` in [-1, 1]. Uses OpenCV; raises ``ValueError`` when the clip is too short.
    """
    import cv2  # noqa: PLC0415

    cap = cv2.VideoCapture(str(path))
    frames, i = [], 0
    while len(frames) < num_frames:
        ok, frame = cap.read()
        if not ok:
            break
        if i % stride == 0:
            h0, w0 = frame.shape[:2]
            s = max(height / h0, width / w0)
            frame = cv2.resize(frame, (max(width, round(w0 * s)), max(height, round(h0 * s))),
                               interpolation=cv2.INTER_AREA)
            top, left = (frame.shape[0] - height) // 2, (frame.shape[1] - width) // 2
            frames.append(cv2.cvtColor(frame[top:top + height, left:left + width], cv2.COLOR_BGR2RGB))
        i += 1
    cap.release()
    if len(frames) < num_frames:
        raise ValueError(f"{path}: {len(frames)} frames after stride {stride}, need {num_frames}")
    v = torch.from_numpy(np.stack(frames)).permute(3, 0, 1, 2).float()
    return v / 127.5 - 1
