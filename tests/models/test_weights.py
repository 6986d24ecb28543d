"""One message shape for every missing set of released weights (models/weights.py)."""

import pytest

from models.weights import MissingWeightsError, require_local_weights


def test_missing_weights_say_what_to_download_and_how_to_pass_it(tmp_path):
    kw = dict(what="VAE weights", repo="org/vae", option="data.vae_path={dir}", example_dir="/models/vae")
    for path in (None, str(tmp_path / "absent"), str(tmp_path)):  # the last one lacks config.json
        with pytest.raises(MissingWeightsError) as e:
            require_local_weights(path, **kw)
        msg = str(e.value)
        assert repr(path) in msg and "huggingface-cli download org/vae --local-dir /models/vae" in msg
        assert "data.vae_path=/models/vae" in msg
    (tmp_path / "config.json").write_text("{}")
    assert require_local_weights(str(tmp_path), **kw) == str(tmp_path)
    assert require_local_weights(str(tmp_path / ".."), marker=None, **kw)  # any folder when no marker


def test_every_loader_of_released_weights_uses_it(tmp_path):
    from models.wan import check_weights_dir  # noqa: PLC0415
    from tasks.image_gen.sana_decode import load_dcae  # noqa: PLC0415
    from tasks.image_gen.sana_metrics import load_clip_score  # noqa: PLC0415
    from tasks.image_gen.vae import load_vae  # noqa: PLC0415

    for load, repo in ((load_vae, "sd-vae-ft-ema"), (load_dcae, "dc-ae"), (load_clip_score, "clip-vit"),
                       (check_weights_dir, "Wan2.1")):
        with pytest.raises(MissingWeightsError, match=repo):
            load(str(tmp_path / "absent"))
