# Executed inside the hook cell (after CHECKPOINTS = []): a random-weight OpenCLIP-layout ViT-B/32
# image tower saved as a torch state dict, random CLIP-sized images and a random classifier.
import importlib.machinery as _im, pickle as _pk, sys as _sys, types as _ty
import numpy as _np
_sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(os.environ["CH7_HOOK"])), "..", "..", "tests"))
from test_vit import to_open_clip_state_dict as _to_sd
try:
    import torch as _torch
except ImportError:  # CPU dry run here: a stand-in whose load() unpickles numpy arrays
    _torch = _ty.ModuleType("torch")
    _torch.__spec__ = _im.ModuleSpec("torch", None)
    _torch.load = lambda path, **kw: _pk.load(open(path, "rb"))
    _torch.save = lambda obj, path: _pk.dump(obj, open(path, "wb"))
    _torch.from_numpy = lambda a: a
    _sys.modules["torch"] = _torch
_depth = int(os.environ.get("CH7_HOOK_DEPTH", "12"))
_c = mm.vit_b32_config()._replace(num_classes=512, ln_eps=1e-5, gelu="quick", pre_norm=True,
                                  patch_bias=False, head_bias=False, depth=_depth)
_p = mm.init_vit(jax.random.PRNGKey(11), _c)
_sd = {k: _torch.from_numpy(_np.ascontiguousarray(v)) for k, v in _to_sd(_p, _c).items()}
_torch.save(_sd, "/tmp/clip_b32_random.pt")
CHECKPOINTS = ["/tmp/clip_b32_random.pt"] * int(os.environ.get("CH7_HOOK_N", "2"))
_nb, _bs = int(os.environ.get("CH7_HOOK_BATCHES", "8")), int(os.environ.get("CH7_HOOK_BATCH", "32"))
_ki, _kl, _kc = jax.random.split(jax.random.PRNGKey(12), 3)
imagenet_batches = (jax.random.normal(_ki, (_nb, _bs, 224, 224, 3)),
                    jax.random.randint(_kl, (_nb, _bs), 0, 1000))
CLASSIFIER = _np.asarray(jax.random.normal(_kc, (1000, 512)) / 512 ** 0.5)
print("hook smoke test:", len(CHECKPOINTS), "checkpoints, depth", _depth, ",", _nb, "x", _bs,
      "random images")
