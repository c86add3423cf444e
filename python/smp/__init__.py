"""smp: pipeline- and data-parallel training of PyTorch models, configured by an SMP-style JSON file.

Every process of the job runs the same script, launched by smprun (``smprun -n 8 -- python train.py``)::

    import torch, smp

    smp.init("config.json")                       # partitions, microbatches, pipeline, ddp, ...
    torch.manual_seed(0)                          # every rank builds the same weights
    net = MyModel()                               # any nn.Module: stages are cut between its children
    model = smp.DistributedModel(net, sample)     # sample: one microbatch; rank 0 profiles and partitions
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    for inputs, targets in batches:               # the global batch, the same on every rank
        optimizer.zero_grad()
        out = model.train_step(inputs, targets, torch.nn.functional.cross_entropy)
        optimizer.step()
    validation = model.evaluate(inputs, targets, torch.nn.functional.cross_entropy).loss

Modules run as they are, in Python (the engine calls each stage module's forward); a module compiled with
``torch.jit.script`` runs as TorchScript, without Python. The engine trains the model's own parameter tensors:
``model.named_parameters()`` returns this rank's, named as in the model's ``state_dict()`` (a scripted module is
copied, so there they are the copy's).
"""

import json
import os

import torch  # noqa: F401 - loads LibTorch before the extension that links it

from . import _materialize, _smp, _state, ep, tp  # noqa: F401 - smp.ep and smp.tp are public
from ._checkpoints import Checkpointer, export_checkpoint, export_safetensors, latest_checkpoint, load_full_model
from ._clip import take_over_torch_clipping
from ._distributed_model import DistributedModel, StepResult  # noqa: F401 - what train_step returns
from ._distributed_optimizer import DistributedOptimizer, refuse_grad_scaler
from ._graph import GraphModel
from ._planning import Plan, plan
from ._smp import CheckpointError, CommError, ConfigError, ModelError, NonFiniteError
from ._state import runtime

__all__ = ["init", "runtime", "GraphModel", "DistributedModel", "DistributedOptimizer", "Checkpointer", "materialize",
           "plan", "Plan",
           "latest_checkpoint", "export_checkpoint", "export_safetensors", "load_full_model",
           "ConfigError", "ModelError", "NonFiniteError", "CheckpointError", "CommError"]


def init(config, sections=None):
    """Joins the job: reads the config (a JSON file path, or a dict holding what the file would), checks it against
    the launch (smprun's environment), and connects to the other processes. Returns the runtime (rank, pp_rank,
    dp_rank, ...). Raises ConfigError for a bad config and CommError when peers do not show up in time.

    A config with an "smp" section may hold the application's own sections beside it; `sections` names those the
    application reads (e.g. ("model", "training")), and any other top-level key is then a ConfigError naming it
    (an smp key put beside the section always is)."""
    if isinstance(config, dict):
        parsed = _smp.Config.from_json_text(json.dumps(config), "smp.init's config")
    else:
        parsed = _smp.Config.from_file(os.fspath(config))
    if sections is not None:
        parsed.check_sections(list(sections))
    _state.set_runtime(_smp.Runtime.init(parsed))
    device = torch.device(_state.runtime().device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the rank's GPU is the current one: .cuda() and torch.device("cuda") find it
    take_over_torch_clipping()  # torch.nn.utils.clip_grad_norm_ over a DistributedModel: the whole model's norm
    refuse_grad_scaler()  # a GradScaler over a DistributedOptimizer says what smp does instead
    return _state.runtime()


def materialize(model, device="cpu", seed=0, init_fn=None):
    """A model built on the meta device made real on `device`, every module initialized from a generator seeded by
    (seed, its path), as each rank of a job whose config has this "seed" initializes its own stages: the same weights
    in one process, for the single-process reference or for inference. Modules are initialized with their own
    reset_parameters(), or init_fn(module) (a Hugging Face model's: init_fn=model._init_weights). Returns the
    model."""
    return _materialize.materialize(model, device, seed, init_fn)
