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

from . import _materialize, _planning, _smp, _state, ep, tp  # noqa: F401 - smp.ep and smp.tp are public
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


def _as_json(config, where=()):
    """The dict as JSON text; a key whose value JSON cannot hold (nan, a tensor) is named, not left to the parser's
    line and column of text the caller never wrote."""
    for key, value in config.items():
        path = (*where, str(key))
        if isinstance(value, dict):
            _as_json(value, path)
            continue
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise ConfigError(f"smp.init's config: key \"{'.'.join(path)}\": {value!r} is not a JSON value (a number, "
                              "string, true/false, null, list or object)") from None
    return json.dumps(config)


def init(config=None, sections=None):
    """Joins the job: reads the config (a JSON file path, or a dict holding what the file would), checks it against
    the launch (smprun's environment), and connects to the other processes. Returns the runtime (rank, pp_rank,
    dp_rank, ...). Raises ConfigError for a bad config and CommError when peers do not show up in time. Without a
    config, SageMaker's SM_HP_MP_PARAMETERS (the modelparallel "parameters" it passes a training job) is read, as SMP's
    smp.init() reads it.

    A config with an "smp" section may hold the application's own sections beside it; `sections` names those the
    application reads (e.g. ("model", "training")), and any other top-level key is then a ConfigError naming it
    (an smp key put beside the section always is)."""
    if config is None:
        given = os.environ.get("SM_HP_MP_PARAMETERS")
        if given is None:
            raise ConfigError("smp.init: no config: pass a JSON file's path or a dict of smp's keys (SageMaker's "
                              "SM_HP_MP_PARAMETERS, which SMP's smp.init() reads, is not set)")
        parsed = _smp.Config.from_json_text(given, "SM_HP_MP_PARAMETERS")
    elif isinstance(config, dict):
        parsed = _smp.Config.from_json_text(_as_json(config), "smp.init's config")
    else:
        parsed = _smp.Config.from_file(os.fspath(config))
    if sections is not None:
        parsed.check_sections(list(sections))
    _planning.forget_adopted_plan()
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


# SageMaker SMP's module-level API, which smp does not have, and what takes its place: a ported script's first call
# of one says so rather than "module 'smp' has no attribute".
_SMP_NAMES = {
    "step": "smp has no step decorator: model.train_step(inputs, targets, loss_fn) runs the forward and backward of "
            "every microbatch (its .loss is their mean over the replicas; keep_outputs=True keeps .outputs), "
            "model.evaluate(...) the forwards",
    "rank": "smp.runtime().rank", "size": "smp.runtime().world_size",
    "local_rank": "smp.runtime().local_rank (the launcher's LOCAL_RANK; smp.runtime().device is the rank's device)",
    "local_size": "smp.runtime().local_world_size (the ranks on this host)",
    "num_microbatches": "smp.runtime().config.microbatches",
    "is_initialized": "smp.runtime(), which raises RuntimeError before smp.init",
    "set_activation_checkpointing": "\"activation_checkpointing\" in the config: true (every stage), stages, or "
                                    "module paths (e.g. [\"transformer.h.0\", \"transformer.h.1\"])",
    "dp_rank": "smp.runtime().dp_rank (the replica: SMP's rdp_rank)",
    "dp_size": "smp.runtime().data_parallel_degree (the replicas: SMP's rdp_size)",
    "rdp_rank": "smp.runtime().dp_rank", "rdp_size": "smp.runtime().data_parallel_degree",
    "pp_rank": "smp.runtime().pp_rank", "pp_size": "smp.runtime().config.partitions",
    "mp_rank": "smp.runtime().pp_rank (and .tp_rank)",
    "mp_size": "smp.runtime().config.partitions times smp.runtime().tensor_parallel_degree",
    "tp_rank": "smp.runtime().tp_rank", "tp_size": "smp.runtime().tensor_parallel_degree",
    "barrier": "smp.runtime().all_reduce_sum(torch.zeros(1)), which every rank joins",
    "broadcast": "every rank computes the same value (the global batch, seeded alike), or smp.runtime()."
                 "all_reduce_sum of a tensor that is zero but on one rank",
    "save": "torch.save on the ranks you choose; the model's state: smp.Checkpointer, smp.export_safetensors",
    "load": "torch.load; a whole model: smp.load_full_model, DistributedModel.load_parameters",
    "save_checkpoint": "smp.Checkpointer(model, optimizer) with \"checkpoint_dir\" in the config: .save(step)",
    "resume_from_checkpoint": "smp.Checkpointer(model, optimizer) with \"resume\": true: .resume() returns the step",
    "partition": "\"partition_overrides\" in the config ({module path: stage}) pins modules to stages",
    "set_partition": "\"partition_overrides\" in the config ({module path: stage}) pins modules to stages",
    "tensor_parallelism": "\"tensor_parallel_degree\" in the config, with the model's built-in plan or "
                          "DistributedModel(..., tp_plan=...) (smp.tp)",
    "set_tensor_parallelism": "DistributedModel(..., tp_plan={module path: smp.tp.Colwise() ...})",
    "delay_param_initialization": "build the model under torch.device(\"meta\"): each rank materializes its "
                                  "stages (smp.materialize, load_pretrained)",
    "nn": "smp.tp's layers (ColumnParallelLinear, RowParallelLinear, ...) and torch.nn.SyncBatchNorm",
    "amp": "\"fp16\": true or \"bf16\": true in the config",
}


def __getattr__(name):
    if name in _SMP_NAMES:
        raise AttributeError(f"module 'smp' has no attribute '{name}' (SageMaker SMP's); here: {_SMP_NAMES[name]}. "
                             "README: Coming from SageMaker SMP")
    raise AttributeError(f"module 'smp' has no attribute '{name}'")
