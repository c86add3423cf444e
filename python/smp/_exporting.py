"""torch.export of a whole model as smp captures it: every input dimension left to export where the model lets it
change, on the sample's shapes where it cannot; a model built on the meta device exported as if on the job's
device; export's failures as CaptureError naming the line of the model's code."""

import inspect

import torch
import torch.utils._pytree as pytree

from ._smp import ConfigError, ModelError


class CaptureError(Exception):
    pass


def _model_frame(error):
    """Where in the model's own code (not torch's) the export failed: 'file:line in function: code'."""
    import os
    import traceback
    torch_dir = os.path.dirname(torch.__file__)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if not frame.filename.startswith(torch_dir) and not frame.filename.startswith(os.path.dirname(__file__))]
    if not frames:
        return None
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def _every_dimension_free(model, args, kwargs):
    """Export's dynamic_shapes with every dimension of every tensor input left to export (Dim.AUTO): those the model
    lets change become symbols, those it needs fixed (a patch size, channels) keep the sample's size."""
    def free(value):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return {dim: torch.export.Dim.AUTO for dim in range(value.dim())}
        return None

    # By the forward's parameter names, as export binds the inputs: keyword arguments a forward takes through
    # **kwargs (use_cache given to a BERT) sit under that parameter's name.
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return {name: pytree.tree_map(free, value) for name, value in bound.items()}


def export_model(model, args, kwargs):
    """The model exported so that its inputs' shapes may change where the model allows (a sequence length, the batch
    of a short last step), else on the sample's shapes: (exported program, why the shapes are fixed or None)."""
    try:
        dynamic = _every_dimension_free(model, args, kwargs)
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False), None
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - export raises many kinds; the fixed-shape export says what is wrong
        text = str(error).strip()
        reason = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
    return _export_fixed(model, args, kwargs), reason


def _export_fixed(model, args, kwargs):
    try:
        return torch.export.export(model, args, kwargs, strict=False)
    except ConfigError:
        raise  # what the job's config cannot do with this input (a sequence tensor parallelism cannot split)
    except Exception as error:  # noqa: BLE001 - export raises many kinds
        text = str(error).strip()
        first = text.splitlines()[0] if text else ""
        where = _model_frame(error)
        raise CaptureError(f"{type(error).__name__}: {first}" + (f" (at {where})" if where else "")) from error


def export_as_if_on(device, model, args, kwargs):
    """Exports a model built on the meta device as if its tensors were on `device`, where the job runs it: model code
    that branches on the device (transformers' experts count tokens with histc on floats on a CPU, on integers
    elsewhere) takes the branch that will run. Its tensors stand in as fake tensors on that device for the export,
    and are the model's own meta tensors again afterwards."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    converter = mode.fake_tensor_converter

    def fake(tensor):
        return converter.from_meta_and_device(mode, tensor.to("meta"), device)

    originals = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is not None:
                    originals.append((table, key, tensor))
    stand_ins = {}
    try:
        for table, key, tensor in originals:
            if id(tensor) not in stand_ins:  # a tied tensor stays one tensor
                stand_in = fake(tensor)
                stand_ins[id(tensor)] = torch.nn.Parameter(stand_in, tensor.requires_grad) \
                    if isinstance(tensor, torch.nn.Parameter) else stand_in
            table[key] = stand_ins[id(tensor)]
        with mode:
            args, kwargs = pytree.tree_map(lambda v: fake(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
            return export_model(model, args, kwargs)
    finally:
        for table, key, tensor in originals:
            table[key] = tensor


def real_constant(value, target, name):
    """A tensor the forward made from literals: exported on fake tensors (a meta-built model), its value is the one
    the fake tensor remembers."""
    from torch._subclasses.fake_tensor import FakeTensor
    if not isinstance(value, FakeTensor):
        return value
    if value.constant is None:
        raise ModelError(f"{name}'s forward makes a constant tensor ({target}) whose value a model built on the meta "
                         "device does not have; build the model on a real device, or compute it from the inputs")
    return value.constant
