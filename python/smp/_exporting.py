"""torch.export of a whole model as smp captures it: every input dimension (or those dynamic_shapes names) left to
export where the model lets it change, on the sample's shapes where it cannot; a model built on the meta device
exported as if on the job's device; export's failures as CaptureError naming the line of the model's code."""

import collections.abc
import contextlib
import inspect

import torch
import torch.utils._pytree as pytree

from ._smp import ConfigError, ModelError


class CaptureError(Exception):
    pass


def _model_frame(error):
    """Where in the model's own code (not torch's) the export failed: 'file:line in function: code'."""
    import os
    import sysconfig
    import traceback
    ours = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    stdlib = sysconfig.get_paths()["stdlib"]

    def models_code(name):  # not exec'd code, torch's, smp's, or Python's own (where conda puts site-packages too)
        return not name.startswith(("<", *ours)) and (not name.startswith(stdlib) or "site-packages" in name)

    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if models_code(frame.filename)]
    if not frames:
        return None
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def dynamic_shapes(model, args, kwargs, choice=None):
    """Which input dimensions the export leaves free to change: (export's dynamic_shapes, {id(tensor leaf): the
    dimensions smp kept at the sample's size}). A free dimension is left to export (Dim.AUTO): it becomes a symbol
    where the model lets it change and keeps the sample's size where the model's code fixes it (a patch size).

    choice None or "all": every dimension of every input. "batch": the first alone (packed sequences of one length:
    a decoder's export 15 to 25% quicker, GPT-2 0.76 against 0.92 s, Mixtral 1.45 against 1.72). "none": the
    sample's shapes (GPT-2 0.42 s). {input name: dimensions}: only those of the named inputs (an image's batch,
    {"pixel_values": [0]}: Swin's export 1.0 against 6.3 s, DenseNet-121's 3.4 against 5.9), every one of the
    others."""
    if choice not in (None, "all", "batch", "none") and not isinstance(choice, collections.abc.Mapping):
        raise ConfigError(f"dynamic_shapes must be None, \"all\", \"batch\", \"none\" or a dict of input name to "
                          f"dimensions, got {choice!r}")
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None, {}  # inputs the forward does not take: the export says so, naming the model's line
    extra = dict(choice) if isinstance(choice, collections.abc.Mapping) else {}
    unknown = sorted(set(extra) - set(bound))
    if unknown:
        raise ConfigError(f"dynamic_shapes names {', '.join(map(repr, unknown))}, which the sample does not give "
                          f"{type(model).__name__}'s forward (it gives {', '.join(map(repr, bound))})")
    held = {}
    anything_free = False

    def free_of(name):
        def free(value):
            nonlocal anything_free
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                return None
            if choice == "none":
                dims = set()
            elif choice == "batch":
                dims = {0}
            elif name in extra:
                dims = set()
            else:
                dims = set(range(value.dim()))
            for dim in extra.get(name, ()):
                if not isinstance(dim, int) or not -value.dim() <= dim < value.dim():
                    raise ConfigError(f"dynamic_shapes[{name!r}] names dimension {dim!r}; the sample's {name!r} has "
                                      f"{value.dim()} dimensions")
                dims.add(dim % value.dim())
            held[id(value)] = set(range(value.dim())) - dims
            anything_free = anything_free or bool(dims)
            return {dim: torch.export.Dim.AUTO for dim in sorted(dims)} or None
        return free

    # By the forward's parameter names, as export binds the inputs: keyword arguments a forward takes through
    # **kwargs (use_cache given to a BERT) sit under that parameter's name.
    shapes = {name: pytree.tree_map(free_of(name), value) for name, value in bound.items()}
    # Nothing free: no dynamic_shapes at all, so that export_model exports once, on the sample's shapes.
    return (shapes if anything_free else None), held


def export_model(model, args, kwargs, shapes):
    """The model exported so that its inputs' shapes may change where `shapes` (dynamic_shapes' first) lets them and
    the model allows (a sequence length, the batch of a short last step), else on the sample's shapes: (exported
    program, why the shapes are fixed or None). `shapes` None: on the sample's shapes alone."""
    if shapes is None:
        return _export_fixed(model, args, kwargs), None
    try:
        with _keywords_spread(model, args, kwargs, shapes) as shapes:
            return _export(model, args, kwargs, dynamic_shapes=shapes), None
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - export raises many kinds; the fixed-shape export says what is wrong
        text = str(error).strip()
        reason = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
        through = _through_var_keyword(model, args, kwargs)
        if through and "tree_name" in text:  # torch 2.11's words for any input under **kwargs
            reason = (f"torch.export leaves no shape free while inputs go through the forward's **kwargs "
                      f"({', '.join(map(repr, through))}); every batch must then have the sample's shapes")
    return _export_fixed(model, args, kwargs), reason


@contextlib.contextmanager
def _keywords_spread(model, args, kwargs, shapes):
    """torch 2.11's export takes no dynamic_shapes for inputs under a forward's **kwargs (Hugging Face's
    num_items_in_batch, passed on to the loss): for the export, the model's forward is seen with those inputs as
    keyword parameters of their own, and yields dynamic_shapes by those names. The module, its paths and its call
    stay the same."""
    through = _through_var_keyword(model, args, kwargs)
    if not through or not isinstance(shapes, dict):
        yield shapes
        return
    forward = model.forward
    signature = inspect.signature(forward)
    var_keyword = next(p for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD)
    parameters = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    parameters += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in through]

    def spread(*call_args, **call_kwargs):
        return forward(*call_args, **call_kwargs)

    spread.__signature__ = signature.replace(parameters=parameters)
    spread_shapes = {name: shape for name, shape in shapes.items() if name != var_keyword.name}
    spread_shapes.update(shapes.get(var_keyword.name) or {name: None for name in through})
    had_own = "forward" in model.__dict__
    model.forward = spread
    try:
        yield spread_shapes
    finally:
        if had_own:
            model.forward = forward
        else:
            del model.forward


def _through_var_keyword(model, args, kwargs):
    """The names of the inputs that a forward takes through its **kwargs."""
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return []
    return [name for parameter in signature.parameters.values() if parameter.kind is parameter.VAR_KEYWORD
            for name in bound.get(parameter.name, {})]


def _export(model, args, kwargs, **options):
    """Non-strict export without fake tensors' dispatch cache: a capture runs each operation once, where the cache's
    entries cost more than they save (symbolic sizes rebuilt on every hit): 20 to 35% of the export of a Hugging
    Face decoder (GPT-2 1.17 against 0.80 s, Mixtral 2.1 against 1.6; one process, 2026-11-27)."""
    import torch._dynamo.config
    with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        return torch.export.export(model, args, kwargs, strict=False, **options)


def _export_fixed(model, args, kwargs):
    try:
        return _export(model, args, kwargs)
    except ConfigError:
        raise  # what the job's config cannot do with this input (a sequence tensor parallelism cannot split)
    except Exception as error:  # noqa: BLE001 - export raises many kinds
        text = str(error).strip()
        first = text.splitlines()[0] if text else ""
        where = _model_frame(error)
        raise CaptureError(f"{type(error).__name__}: {first}" + (f" (at {where})" if where else "") +
                           _hint(error, first, where)) from error


def _hint(error, first, where=None):
    """What a user can do about an export failure whose text does not say it."""
    import re
    if "DataDependent" in type(error).__name__ and where and "expert" in where:
        # transformers' eager experts loop over the experts a batch routes to: a count the export cannot know.
        return ('; a mixture of experts\' experts in transformers\' "eager" form loop over the experts each batch '
                'routes to, which torch.export cannot capture: build the model with experts_implementation='
                '"grouped_mm" or "batched_mm" (in its config or from_pretrained), or divide the experts over ranks '
                'with "expert_parallel_degree"')
    unhashable = re.fullmatch(r"unhashable type: '(\w+)'", first) if isinstance(error, TypeError) else None
    if unhashable:  # export's words for an output of a class pytree does not know
        return (f"; if the forward returns a {unhashable.group(1)} (a dataclass or other class of its own), register "
                f"it so that its tensors can be found: torch.export.register_dataclass({unhashable.group(1)}), or "
                "torch.utils._pytree.register_pytree_node for another class")
    return ""


def export_as_if_on(device, model, args, kwargs, shapes):
    """Exports a model built on the meta device as if its tensors were on `device`, where the job runs it: model code
    that branches on the device (transformers' experts count tokens with histc on floats on a CPU, on integers
    elsewhere) takes the branch that will run."""
    with on_fake_tensors(device, model, args, kwargs) as (args, kwargs):
        return export_model(model, args, kwargs, shapes)


@contextlib.contextmanager
def on_fake_tensors(device, model, args, kwargs, shape_env=None):
    """Yields (args, kwargs) as fake tensors on `device`, inside their fake mode, the model's parameters and buffers
    standing in as fake tensors there too (a tied tensor stays one), and its own tensors again afterwards: the model
    runs without reading or writing a value of its own, whatever device (meta included) holds them. `shape_env`:
    lets operations whose output size depends on values (nonzero) run, their sizes unbacked symbols."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env)
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
            if id(tensor) not in stand_ins:
                stand_in = fake(tensor)
                stand_ins[id(tensor)] = torch.nn.Parameter(stand_in, tensor.requires_grad) \
                    if isinstance(tensor, torch.nn.Parameter) else stand_in
            table[key] = stand_ins[id(tensor)]
        with mode:
            yield pytree.tree_map(lambda v: fake(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
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
