"""Local pretrained weights: nothing is downloaded at run time, and a missing folder says what to fetch.

Every loader of released weights (VAE, DC-AE, CLIP, the SANA pipeline, Wan2.1) calls :func:`require_local_weights`
first, so the message has one shape everywhere: what is missing, which Hugging Face repository holds it, the
command that downloads it on a machine with internet access, and the option that points to the copy.
"""

from __future__ import annotations

import os


class MissingWeightsError(FileNotFoundError):
    """Released weights that must be downloaded once and passed by path."""


def require_local_weights(path: str | None, *, what: str, repo: str, option: str, example_dir: str,
                          marker: str | None = "config.json", contents: str = "") -> str:
    """Return ``path`` if it is a folder (holding ``marker`` when given); else raise :class:`MissingWeightsError`.

    Args:
        what: the weights in words ("VAE weights"). repo: the Hugging Face repository id.
        option: how to pass the folder, with a ``{dir}`` placeholder ("data.vae_path={dir}").
        example_dir: the local folder used in the message. marker: a file the folder must hold (None: any folder).
        contents: what the folder holds, for the message (optional).
    """
    ok = bool(path) and os.path.isdir(path) and (marker is None or os.path.isfile(os.path.join(path, marker)))
    if not ok:
        holds = f" ({contents})" if contents else ""
        raise MissingWeightsError(
            f"{what} not found at {path!r}. Nothing is downloaded at run time: download {repo} once on a machine "
            f"with internet access (e.g. `huggingface-cli download {repo} --local-dir {example_dir}`), copy the "
            f"folder{holds} here and pass {option.format(dir=example_dir)}")
    return path
