"""A model's inputs and outputs as the user has them (a tensor, a tuple of positional arguments, a dict of keyword
arguments; a tensor, tuple, dict or ModelOutput back) against the engine's flat lists of named tensors."""

import collections.abc
import inspect

import torch
import torch.utils._pytree as pytree

from ._smp import ConfigError, ModelError


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:80]


class GraphIO:
    """A GraphModel's inputs by name (a dict, a tuple in input order, or one tensor for a model of one input), its
    outputs as one tensor or a tuple (set_outputs)."""

    def __init__(self, input_names, several_outputs):
        self.input_names = list(input_names)
        self.several_outputs = several_outputs

    def engine_inputs(self, inputs, what="inputs"):
        names = self.input_names
        if isinstance(inputs, torch.Tensor):
            values = [inputs]
        elif isinstance(inputs, (tuple, list)):
            values = list(inputs)
        elif isinstance(inputs, collections.abc.Mapping):
            unknown = [key for key in inputs if key not in names]
            if unknown:
                raise ConfigError(f"{what}: '{unknown[0]}' is not an input of the model (its inputs: {', '.join(names)})")
            missing = [name for name in names if name not in inputs]
            if missing:
                raise ConfigError(f"{what}: no '{missing[0]}' (the model's inputs: {', '.join(names)})")
            values = [inputs[name] for name in names]
        else:
            raise TypeError(f"{what}: expected a tensor, a tuple or a dict of tensors, got {type(inputs).__name__}")
        if len(values) != len(names):
            raise ConfigError(f"{what}: {len(values)} values for the model's {len(names)} inputs ({', '.join(names)})")
        for name, value in zip(names, values):
            if value is not None and not isinstance(value, torch.Tensor):
                raise ConfigError(f"{what}: input '{name}' is {_describe(value)}, not a tensor")
        return values

    def check_microbatch(self, engine_inputs, batched, microbatches, what, replicas=1, short_allowed=False):
        pass  # a GraphModel's modules take any shape they accept

    def microbatch_range(self):
        return 1, 0

    def model_outputs(self, outputs):
        return tuple(outputs) if self.several_outputs else outputs[0]


class CapturedIO:
    """A captured model's inputs: the sample's structure of positional and keyword arguments, whose tensors are the
    engine's inputs and whose other values (None, flags) were baked into the capture; its outputs rebuilt from the
    engine's tensors into what the model's forward returns (a ModelOutput, tuple, dict)."""

    def __init__(self, model, sample_args, sample_kwargs, leaf_inputs, output_spec, shapes):
        self._model = model
        self._positional = len(sample_args)
        self._keys = list(sample_kwargs)
        self._sample_leaves = pytree.tree_leaves((sample_args, sample_kwargs))
        self._leaf_inputs = leaf_inputs  # per leaf: the engine input's name, or None (baked in)
        self._out_spec, self._output_constants = output_spec
        self.input_names = [name for name in leaf_inputs if name is not None]
        self._shapes = shapes  # _export_capture.InputShapes: which dimensions may change, and how far

    def engine_inputs(self, inputs, what="inputs"):
        args, kwargs = split_sample(self._model, inputs)
        if len(args) != self._positional:
            raise ConfigError(f"{what}: {len(args)} positional inputs, the sample had {self._positional}")
        extra = [key for key in kwargs if key not in self._keys]
        if extra:
            raise ConfigError(f"{what}: input '{extra[0]}' was not in the sample the model was captured with "
                              f"(its inputs: {', '.join(self._keys)}); pass the same inputs as the sample")
        missing = [key for key in self._keys if key not in kwargs]
        if missing:
            raise ConfigError(f"{what}: no '{missing[0]}', which the sample had: a captured model takes the sample's "
                              "inputs (one it computes its loss from, such as labels, too: give placeholder values, "
                              "e.g. labels=input_ids, when only the outputs are wanted)")
        ordered = {key: kwargs[key] for key in self._keys}
        leaves, _ = pytree.tree_flatten((args, ordered))
        if len(leaves) != len(self._sample_leaves):
            raise ConfigError(f"{what}: the inputs hold {len(leaves)} values, the sample held {len(self._sample_leaves)}")
        values = []
        for leaf, sample, name in zip(leaves, self._sample_leaves, self._leaf_inputs):
            if name is not None:
                if not isinstance(leaf, torch.Tensor):
                    raise ConfigError(f"{what}: input '{name}' is {_describe(leaf)}; the sample had a tensor there")
                values.append(leaf)
            elif isinstance(leaf, torch.Tensor) or leaf != sample:
                if kwargs.get("use_cache") is True:
                    raise ConfigError(f"{what}: use_cache=True makes the forward return its key/value cache, which "
                                      "pipeline stages do not pass on: leave use_cache out (smp passes "
                                      "use_cache=False) or pass use_cache=False")
                raise ConfigError(f"{what}: {_describe(leaf)} where the sample had {_describe(sample)}, which the "
                                  "capture keeps as it was; pass the sample's value, or give a value that changes "
                                  "from step to step as a tensor (torch.tensor(value)) in the sample and in every "
                                  "batch")
        return values

    def check_microbatch(self, engine_inputs, batched, microbatches, what, replicas=1, short_allowed=False):
        """Each microbatch must have a shape the captured code takes: the sample's in the dimensions the model fixes
        (views, a patch size), any size export allowed in the others (a sequence length, a short last batch). The
        engine splits as torch.tensor_split does, into `replicas` shares (of a global batch) and each into
        microbatches: where a batch does not split evenly, the first pieces have a sample more, and every size is
        checked, every replica's on every rank, so that all refuse alike. `short_allowed` (evaluation): a share of
        fewer samples than microbatches is split into one a sample, an empty share into none, as the engine does."""
        def pieces_of(value):
            shares = torch.tensor_split(value, replicas)
            return [piece for share in shares if len(share)
                    for piece in torch.tensor_split(share, min(microbatches, len(share)) if short_allowed
                                                    else microbatches)]
        split = [pieces_of(value) if is_batched else None for value, is_batched in zip(engine_inputs, batched)]
        pieces = next((len(parts) for parts in split if parts is not None), 0)

        def microbatch(index):
            return {name: parts[index] if parts is not None else value
                    for name, value, parts in zip(self.input_names, engine_inputs, split)}

        sizes = [next((len(parts[index]) for parts in split if parts is not None), None) for index in range(pieces)]
        normed = self._one_value_norms(batch_statistics_now=True, training=what == "train_step") if 1 in sizes else []
        if normed:
            # Export's least of 2, which smp does not enforce, was also what kept one sample from batch norm's own
            # check: the captured code would take its statistics over one value a channel (a NaN variance).
            raise ConfigError(f"{what}: a microbatch of 1 sample through batch norm on batch statistics "
                              f"('{normed[0]}', one value a channel per sample), which PyTorch refuses (\"more than 1 "
                              "value per channel\"); give at least 2 samples a microbatch: fewer \"microbatches\", or "
                              "drop the last short batch (DataLoader's drop_last=True)")
        for index in sorted({sizes.index(size) for size in sizes}):  # the first microbatch of each size
            inputs = microbatch(index)
            shapes = {name: list(value.shape) for name, value in inputs.items()}
            for name, shape in shapes.items():
                self._shapes.check(name, shape, what)
            self._shapes.check_agreement(shapes, what)
            self._shapes.check_guards(inputs, what)
        if self._shapes.lookups is not None:
            for index in range(pieces):
                self._shapes.lookups.check(self._model, microbatch(index), what)

    def microbatch_range(self):
        """(least, most) samples a microbatch may have, as the capture allows the batched inputs' first dimension
        (most 0: unbounded) and batch norms of one value a channel per sample (2 at least); the planner leaves out
        layouts beyond them.
        Batched: the sample's inputs whose first dimension is its largest (a position table of one row is not)."""
        sample = {name: leaf for leaf, name in zip(self._sample_leaves, self._leaf_inputs)
                  if name is not None and isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
        rows = max((tensor.shape[0] for tensor in sample.values()), default=0)
        least, most = self._shapes.first_dimension_range([name for name, tensor in sample.items()
                                                          if tensor.shape[0] == rows])
        return (max(least, 2) if self._one_value_norms(batch_statistics_now=False) else least), most

    def _one_value_norms(self, batch_statistics_now, training=True):
        """Paths of the captured batch norms with one value a channel per sample (a (N, C) input, 1 x 1 maps), which
        a microbatch of 1 sample leaves with statistics over one value: those taking batch statistics in this call (a
        train_step's in training mode, or any call's keeping no running ones), or every one (the planner's, whatever
        mode the model is in later)."""
        paths = getattr(self._shapes, "one_value_norms", ())
        if not paths or not batch_statistics_now or not isinstance(self._model, torch.nn.Module):
            return list(paths)
        modules = dict(self._model.named_modules())
        return [path for path in paths if path in modules and
                ((training and modules[path].training) or not getattr(modules[path], "track_running_stats", True))]

    def model_outputs(self, outputs):
        tensors = iter(outputs)
        leaves = [next(tensors) if constant is None else constant for constant in self._output_constants]
        return pytree.tree_unflatten(leaves, self._out_spec)


def own_loss(output):
    """The loss a model computes itself (a Hugging Face model given labels): .loss or ["loss"], a 0-dim output, or a
    0-dim first element."""
    loss = None
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, collections.abc.Mapping) or hasattr(output, "loss"):
        loss = output.get("loss") if isinstance(output, collections.abc.Mapping) else output.loss
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0]
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ModelError(f"loss=None: the model's output ({type(output).__name__}) holds no loss of its own (a "
                         "0-dim .loss, ['loss'] or first element); pass the model its labels, or pass a loss function")
    return loss


def split_sample(model, sample):
    """A sample (or a step's inputs) as (args, kwargs): a tensor is the first positional argument, a tuple or list
    the positional arguments, a dict (or Mapping, e.g. a tokenizer's BatchEncoding) the keyword arguments. A
    forward with a `use_cache` parameter gets use_cache=False unless given: a training step never reads the cache."""
    if isinstance(sample, torch.Tensor):
        args, kwargs = (sample,), {}
    elif isinstance(sample, (tuple, list)):
        args, kwargs = tuple(sample), {}
    elif isinstance(sample, collections.abc.Mapping):
        args, kwargs = (), dict(sample)
    else:
        raise TypeError(f"model inputs must be a tensor, a tuple of positional arguments or a dict of keyword "
                        f"arguments, got {type(sample).__name__}")
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    if "use_cache" in parameters and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    # Hugging Face's Trainer passes num_items_in_batch as a tensor, a program's own loop often as an int, which the
    # capture would keep as the sample's value: as a tensor it may change from step to step.
    count = kwargs.get("num_items_in_batch")
    if isinstance(count, int) and not isinstance(count, bool):
        kwargs["num_items_in_batch"] = torch.tensor(count)
    return args, kwargs
