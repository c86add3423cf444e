"""smp.DistributedModel: this rank's stages of a model (captured whole, or a Sequential or GraphModel) as an
nn.Module, and what its steps return."""

import collections
import collections.abc
import gc
import itertools
import os
import sys
import time
import warnings
import weakref

import torch

from . import _clip, _materialize, _routing, _smp, _sync_batch_norm, tp
from ._evaluation_path import check_mode
from ._graph import GraphModel, _is_sequential, _kind, transient_buffers
from ._model_graph import graph_of, shard_for_tensor_parallelism
from ._model_io import own_loss
from ._planning import adopt_planned_layout, check_room_beside_plan
from ._shared_buffers import check_updated_buffers_on_one_stage
from ._smp import ConfigError, ModelError
from ._state import runtime


def _materializer(model, graph, rt, init_fn):
    """What makes this rank's stages real once the partition is known: the modules owning the tensors its nodes
    read, on its device, each initialized from the generator of (config seed, module path)."""
    names = graph.node_names()

    def materialize_local(local_nodes):
        for node in graph._captured.values():
            node.drop_stand_ins()
        gc.collect()
        _materialize.release_freed_memory()
        paths = set()
        for index in local_nodes:
            node = graph._captured.get(names[index])
            if node is not None:
                paths |= {path for path, _ in itertools.chain(node.named_parameters(), node.named_buffers())}
        replaced = _materialize.materialize_modules(model, {_materialize.owning_module(path) for path in paths},
                                                    torch.device(rt.device), rt.config.seed, init_fn)
        for node in graph._captured.values():
            node.replace_tensors(replaced)

    return materialize_local


class StepResult:
    """What train_step and evaluate return: .loss (the global batch's mean loss, the same on every rank), .skipped,
    .seconds, .gradient_buckets and .buckets_overlapped (the replicas' gradient all-reduce: buckets, and those
    reduced while the backward ran), .forwards_overlapped (overlap_forward_backward), .outputs (keep_outputs: the model's outputs for this replica's share, as the model returns them,
    on the ranks running the last stage; else None), and .tokens_per_expert: for a captured mixture-of-experts
    model, {router module path: how many tokens it sent to each expert} over this step's microbatches, for the
    routers of this rank's stages and this replica's share of the batch (runtime().all_reduce_sum adds the
    replicas'); {} otherwise."""

    def __init__(self, engine_output, outputs, tokens_per_expert=None):
        self.loss = Loss(engine_output.loss) if engine_output.loss is not None else None
        self.skipped = engine_output.skipped
        self.seconds = engine_output.seconds
        self.gradient_buckets = engine_output.gradient_buckets
        self.buckets_overlapped = engine_output.buckets_overlapped
        self.forwards_overlapped = engine_output.forwards_overlapped
        self.outputs = outputs
        self.tokens_per_expert = tokens_per_expert or {}

    def __repr__(self):
        return f"StepResult(loss={self.loss}, skipped={self.skipped}, seconds={self.seconds:.3f})"


class Loss(float):
    """A step's loss: a float (the global batch's mean, the same on every rank) that answers .item() as the tensor a
    training loop expects does; the engine has run its backward already."""

    def item(self):
        return float(self)

    def backward(self, *args, **kwargs):
        raise RuntimeError("train_step ran the backward already (its gradients are in .grad): call optimizer.step()")

    def detach(self):
        return self  # as a logging line's `total += loss.detach()` takes a tensor's

    def cpu(self):
        return self


# A loss saved in a log or a Checkpointer's extra_state reads back where smp is imported: torch.load's weights_only
# reader takes only the classes it is told of (not even float's, which a float subclass pickles by).
torch.serialization.add_safe_globals([Loss])


def _no_loss(output, target):
    """The loss of a forward for inference: zero, on the outputs' device."""
    leaves = [leaf for leaf in torch.utils._pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
    return torch.zeros((), device=leaves[0].device if leaves else "cpu")


_META_NEEDS_CAPTURE = ("a model built on the meta device must be a module with a forward of its own (captured whole); "
                       "build a Sequential or a GraphModel's modules normally")


def _check_enough_modules(model, graph, stages):
    """A captured model cut into fewer pieces than stages, said in the model's terms rather than the partition's."""
    names = graph.node_names()
    if not getattr(graph, "_captured", None) or len(names) >= stages:
        return
    raise ModelError(f"{type(model).__name__} was captured as {len(names)} module(s) "
                     f"({', '.join(repr(n) for n in names[:6])}{', ...' if len(names) > 6 else ''}) for {stages} "
                     "pipeline stages: smp cuts between the modules the forward calls, each stage needs one, and "
                     "parameters the model's own forward uses (an nn.ParameterList, a weight given to F.linear) stay "
                     "with the model; put each layer's in a submodule of its own, or use fewer \"partitions\"")


class DistributedModel(torch.nn.Module):
    """This rank's stages of `model`: an nn.Sequential, an smp.GraphModel, or any nn.Module with a forward of its
    own (an unmodified Hugging Face or torchvision model), captured whole with torch.export and cut at whatever
    depth balance needs. Every rank passes the same model and one microbatch of input as `sample`: a tensor, a
    tuple of positional arguments, or a dict of keyword arguments (input_ids, attention_mask, labels, ...). Rank 0
    profiles the modules on it and all ranks adopt its partition.

    Later steps may bring other shapes where the model lets them change (a sequence length, an epoch's short last
    batch): every input dimension is left to torch.export, unless `dynamic_shapes` says which: "batch" the first
    alone, "none" none (quicker captures), {input name: dimensions} those of the named inputs ({"pixel_values": [0]}:
    an image's size held, a much quicker capture for Swin or DenseNet).

    It is an nn.Module holding this rank's share: named_parameters(), parameters(), named_buffers() and state_dict()
    give this rank's tensors (the ones the engine trains, no copies) under their names in the full model, in the
    model's order; load_state_dict() takes a full model's state_dict (each rank copies its own) or this rank's.
    The whole model's state: a checkpoint exported with smp.export_checkpoint or smp.export_safetensors. Calling
    it, model(inputs), runs the pipeline's forwards for inference (as evaluate, without a loss) and returns the
    model's outputs for this replica's share on the ranks running the last stage, None on the others.

    With "tensor_parallel_degree" > 1 the model is sharded first, in place: by `tp_plan` ({module path pattern:
    style}, see smp.tp), else by the model's own plan (a Hugging Face model's; smp.tp.builtin_plan), else it must be
    built of smp.tp's layers. Parameters and state_dict() are then this rank's shards.

    With "expert_parallel_degree" > 1 a captured mixture-of-experts model's experts modules (Hugging Face's experts
    classes) hold this rank's share of their experts, and tokens reach the others' by all-to-all (smp.ep).

    A model built on the meta device (with torch.device("meta"): ...) is captured there and each rank makes real only
    the modules its stages read, initialized from (config seed, module path) by their reset_parameters(), or by
    `init_fn(module)` (a Hugging Face model's: init_fn=net._init_weights); load_pretrained(path) then reads this
    rank's weights.

    resume=False: the model does not take the checkpoint the config's "resume" finds: a job's other model, which its
    Checkpointer does not save (a frozen teacher, a DPO reference loaded from pretrained weights).

    plan_optimizer: with "auto" layout keys, the optimizer the job will build, as smp.plan's `optimizer` (a
    torch.optim class or a callable making one of a list of parameters: functools.partial(torch.optim.SGD, lr=0.1,
    momentum=0.9)); its state and step are priced as it keeps and times them. Default AdamW.
    """

    def __init__(self, model, sample=None, init_fn=None, tp_plan=None, dynamic_shapes=None, resume=True,
                 plan_optimizer=None, **smp_v1_options):
        super().__init__()
        _refuse_smp_v1_options("DistributedModel", smp_v1_options, _SMP_V1_MODEL_OPTIONS)
        if sample is None:
            raise TypeError("DistributedModel(model, sample): give a sample, one microbatch of inputs as train_step "
                            "takes them: smp profiles and partitions the model on it before training (SMP traced "
                            "the first step instead)")
        empty = next((tuple(leaf.shape) for leaf in torch.utils._pytree.tree_leaves(sample)
                      if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == 0), None)
        if empty is not None:  # export would fail inside the model's code, as if the model could not be captured
            raise ConfigError(f"DistributedModel: the sample holds no samples (a tensor of shape {empty}): give one "
                              "microbatch of at least one (a batch // (replicas x microbatches) rounded to 0?)")
        if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None),
                                                                    torch.nn.Module):
            warnings.warn("smp runs each stage's modules as they are, not compiled: training the module "
                          "torch.compile wrapped, under its own parameter names (README: Not built yet)", stacklevel=2)
            model = model._orig_mod
        # Not a submodule (its tensors are the engine's to list): train()/eval() reach its modules' flags.
        object.__setattr__(self, "_net", model)
        object.__setattr__(self, "_said_eval_mode", False)
        object.__setattr__(self, "_said_share", False)
        rt = runtime()
        started = time.perf_counter()
        # "auto" layout keys: chosen now that the model is known, the same on every rank (smp.plan's prediction).
        self.planned, self._planned_steps, self._planned_routing = None, [], {}
        if _materialize.was_released(model):
            raise ModelError(f"{type(model).__name__} was given to an smp.DistributedModel already, which keeps only "
                             "this rank's parameters of it: build the model anew for another DistributedModel")
        meta = isinstance(model, torch.nn.Module) and _materialize.is_meta(model)
        if meta and (_is_sequential(model) or isinstance(model, (GraphModel, torch.jit.ScriptModule))):
            raise ModelError(_META_NEEDS_CAPTURE)  # before planning, which would run its modules
        real = [name for name, parameter in model.named_parameters() if not parameter.is_meta] if meta else []
        if real and rt.rank == 0:
            # Adapters added outside `with torch.device("meta")`: made on every rank whole, with values their own
            # generator drew, where the meta ones are drawn per (seed, module path) on the ranks that need them.
            print(f"smp: {len(real)} parameter(s) of a model built on the meta device are real ({real[0]}, ...): they "
                  "keep the values they were made with, not drawn from (config seed, module path); build them under "
                  "torch.device(\"meta\") too for the same weights in every run", flush=True)
        if plan_optimizer is not None and not callable(plan_optimizer):  # on every rank, before rank 0 plans
            raise ConfigError(f"plan_optimizer {plan_optimizer!r}: expected a torch.optim class or a callable making "
                              "an optimizer of a list of parameters")
        if rt.config.auto_keys:
            self.planned = adopt_planned_layout(model, sample, dynamic_shapes, tp_plan, plan_optimizer)
        elif plan_optimizer is not None and rt.rank == 0:
            print("smp: plan_optimizer ignored: the config has no \"auto\" layout key to plan", flush=True)
        if rt.tensor_parallel_degree > 1:
            shard_for_tensor_parallelism(model, tp_plan)
        elif tp_plan is not None and rt.rank == 0:
            print("smp: tp_plan ignored: the config's tensor_parallel_degree is 1", flush=True)
        if rt.expert_parallel_degree > 1 and (isinstance(model, (GraphModel, torch.jit.ScriptModule)) or
                                              _is_sequential(model)):
            raise ConfigError(f"\"expert_parallel_degree\" {rt.expert_parallel_degree} divides the experts of a "
                              "captured mixture-of-experts model (a module with a forward of its own, such as a "
                              f"Hugging Face one), not a {_kind(model)}")
        # transformers 5 names it is_activation_checkpointing (the older name warns that it is deprecated).
        checkpointing = getattr(model, "is_activation_checkpointing", None)
        if checkpointing is None:
            checkpointing = getattr(model, "is_gradient_checkpointing", False)
        if checkpointing is True and rt.rank == 0:
            warnings.warn(f"{type(model).__name__}.gradient_checkpointing_enable() recomputes nothing under smp (the "
                          "capture runs each layer once): set \"activation_checkpointing\" in the config (true, or "
                          "the stages or modules to recompute)", stacklevel=2)
        synchronized = _sync_batch_norm.synchronized_modules(model)
        if synchronized:  # each microbatch's statistics pooled over the replicas, in the capture too
            _sync_batch_norm.pool_over_replicas(synchronized, rt.data_parallel_degree)
            if rt.data_parallel_degree > 1:
                rt._use_replica_statistics()
        graph, io_ = graph_of(model, sample, rt.config.num_stages(), list(rt.config.partition_overrides),
                              dynamic_shapes)
        self._io = io_
        self._graph = graph
        _check_enough_modules(model, graph, rt.config.num_stages())
        self._evaluation_checked, self._evaluation_differs = False, None
        # Non-persistent buffers (a rotary table) stay out of checkpoints and exports, as out of state_dict.
        from_module = isinstance(model, torch.nn.Module) and not _is_sequential(model)
        transient = transient_buffers(model) if from_module else list(graph._transient_buffers)
        for node in graph._captured.values():
            transient += transient_buffers(node)  # the constants a capture lifted out of the forward
        graph._graph.set_transient_buffers(transient)
        self._persistent_buffers = set(model.state_dict(keep_vars=True)) if isinstance(model, torch.nn.Module) \
            else set()
        captured = time.perf_counter()
        materialize_local = None
        if meta:
            if not graph._captured:
                raise ModelError(_META_NEEDS_CAPTURE)
            materialize_local = _materializer(model, graph, rt, init_fn)
            for node in graph._captured.values():
                object.__setattr__(node, "_job_device", torch.device(rt.device))
        self._model = _smp.DistributedModel(rt, graph._graph, io_.engine_inputs(sample, "sample"), materialize_local,
                                            resume)
        check_updated_buffers_on_one_stage(model, graph, self._model.stage_of_module)
        # Where construction time went (capture; profiling, partitioning and building the stages), for benchmarks.
        self._seconds = {"capture": captured - started, "engine": time.perf_counter() - captured}
        # The full model's names in its order: named_parameters() and state_dict() follow it, as PyTorch's do.
        full_state = model.state_dict(keep_vars=True) if isinstance(model, torch.nn.Module) else {}
        full_names = list(full_state)
        self._full_names = set(full_names)
        # A tied tensor's other names (lm_head.weight for transformer.wte.weight): load_state_dict takes it by any.
        first_name = {}
        self._aliases = collections.defaultdict(list)
        for name, tensor in full_state.items():
            if id(tensor) in first_name:
                self._aliases[first_name[id(tensor)]].append(name)
            first_name.setdefault(id(tensor), name)
        order = {name: index for index, name in enumerate(full_names)}
        last = len(order)
        self._parameter_names = sorted(self._model.named_parameters(), key=lambda name: order.get(name, last))
        self._buffer_names = sorted(self._model.named_buffers(), key=lambda name: order.get(name, last))
        if not self._parameter_names and isinstance(model, torch.nn.Module) and \
                next(model.parameters(), None) is not None:
            print(f"smp: rank {rt.rank} holds no parameters (its stages {list(self.stages)} have none), so "
                  "torch.optim refuses model.parameters() here (\"optimizer got an empty parameter list\"): the "
                  "partition gives every stage parameters when at least as many modules have some as there are "
                  "stages and \"partition_overrides\" allow it; pin a module with parameters to this stage, or use "
                  "fewer \"partitions\"", file=sys.stderr, flush=True)
        # How DistributedOptimizer finds the model of the parameters it is given: on the tensors, no registry.
        owner = weakref.ref(self)
        for parameter in self._model.named_parameters().values():
            parameter._smp_model = owner
        # Whether some rank trains none of its parameters (a frozen backbone's stage): there an empty list given to
        # torch's clipping is this model's share, which joins the whole norm (_clip); elsewhere it is none of it.
        trains_some = any(p.requires_grad for p in self._model.named_parameters().values())
        ranks = torch.tensor([float(not trains_some), float(trains_some)])  # ranks training none, and some
        if rt.world_size > 1:
            rt.all_reduce_sum(ranks)
        # A model no rank trains (a frozen teacher) has no norm to join.
        self._some_rank_trains_none = bool(ranks[0].item() > 0 and ranks[1].item() > 0)
        if self.planned is None:  # a teacher beside a planned student: the plan did not count it
            tensors = list(self._model.named_parameters().values()) + list(self._model.named_buffers().values())
            gradients = sum(p.nbytes for p in self._model.named_parameters().values() if p.requires_grad)
            check_room_beside_plan(sum(t.nbytes for t in tensors) + gradients,
                                   "model" if gradients else "frozen model")
        if self._some_rank_trains_none and not trains_some and self._parameter_names:
            # The usual optimizer of a partly frozen model (LoRA on some layers) fails here alone, and the other
            # ranks then only see this one leave.
            print(f"smp: rank {rt.rank} trains none of its parameters (its stages {list(self.stages)} are frozen): "
                  "an optimizer over the trainable parameters alone is an empty list here, which torch.optim "
                  "refuses; give it model.parameters() (frozen ones take no step)", file=sys.stderr, flush=True)
        _clip.clipped_by_whole_norm(self)
        if isinstance(model, torch.nn.Module):
            kept = {id(t) for t in self._model.named_parameters().values()}
            _materialize.release_other_stages(model, kept, list(self.stages))

    def _engine_step(self, step, inputs, targets, loss, keep_outputs, replica_share, what, loss_reduction="mean"):
        refusal = None
        try:
            prepared = self._prepare_step(inputs, targets, loss, replica_share, what, loss_reduction)
        except Exception as error:  # noqa: BLE001 - raised below, after the replicas' verdict
            refusal = error
        rt = runtime()
        if replica_share and rt.data_parallel_degree > 1:
            # Each replica checked its own share: every rank learns which refused, so that all refuse the call alike
            # and a loop that skips a bad batch skips it everywhere (one small all-reduce a call).
            verdict = torch.zeros(rt.world_size)
            verdict[rt.rank] = float(refusal is not None)
            rt.all_reduce_sum(verdict)
            refused = [rank for rank in range(rt.world_size) if verdict[rank] > 0]
            if refused and refusal is None:
                refusal = ConfigError(f"{what}: rank{'s' if len(refused) > 1 else ''} "
                                      f"{', '.join(map(str, refused))} refused {'their' if len(refused) > 1 else 'its'} "
                                      "replica's share (replica_share=True; its error says why), so every rank "
                                      "refuses this call: skip the batch on every rank, or fix it")
        if refusal is not None:
            # Refused before any transfer: the call counts here as the engine counts its own refusals, so that a
            # rank refusing alone (a C++ program's own share) is out of step with its peers, and told, not paired
            # with their next call.
            self._model.count_refused_call(what == "train_step")
            raise refusal
        values, targets, engine_loss, batched, reduction, model_outputs = prepared
        result = step(values, targets, engine_loss, keep_outputs, batched, reduction)
        kept = result.all_outputs
        return StepResult(result, model_outputs(kept) if kept is not None else None, _routing.take())

    def _prepare_step(self, inputs, targets, loss, replica_share, what, loss_reduction):
        """The engine's inputs for a call, checked: (values, targets, loss, batched, reduction, model_outputs)."""
        rt = runtime()
        if loss_reduction not in ("mean", "sum"):
            raise ConfigError(f"{what}: loss_reduction must be \"mean\" or \"sum\", got {loss_reduction!r}")
        if what == "train_step":
            _refuse_unscaled_half(rt, what)
        targets, loss = _targets_as_rows(targets, loss, what)
        values = self._io.engine_inputs(inputs, what)
        on_meta = [name for name, value in zip(self._io.input_names or range(len(values)), values)
                   if isinstance(value, torch.Tensor) and value.is_meta]
        if on_meta or (isinstance(targets, torch.Tensor) and targets.is_meta):
            where = f"input '{on_meta[0]}'" if on_meta else "the targets"
            raise ConfigError(f"{what}: {where} is on the meta device, which holds no values: a model may be built "
                              "there, its batches must be real tensors")
        batched = _smp.batched_inputs(values, targets, what)
        microbatches = rt.config.microbatches
        # The engine's refusals of a short share, made here where the replicas vote on them (_engine_step).
        if replica_share and (what == "train_step" or rt.expert_parallel_degree > 1):
            rows = next((v.shape[0] for v, b in zip(values, batched) if b), None)
            if rows is not None and rows < microbatches:
                raise ConfigError(f"{what}: the replica's batch of {rows} samples does not split into {microbatches} "
                                  "microbatches (each needs a sample at least" +
                                  (", and expert parallelism's exchanges need every replica in each)"
                                   if what != "train_step" else ")"))
        # Checked before the split, every replica's microbatches on every rank: all refuse a batch alike.
        replicas = 1 if replica_share else rt.data_parallel_degree
        # An evaluation's batch may be short of filling every microbatch (a validation set's rest): fewer, then.
        short_allowed = what != "train_step"
        if any(b and v.shape[0] >= (1 if short_allowed else microbatches * replicas) for v, b in zip(values, batched)):
            self._io.check_microbatch(values, batched, microbatches, what, replicas, short_allowed)
        global_batch = None
        if not replica_share and not short_allowed:
            rows = next((v.shape[0] for v, b in zip(values, batched) if b), None)
            if rows is not None and rows < microbatches * replicas:
                raise ConfigError(f"{what}: a global batch of {rows} samples is fewer than {replicas} replicas x "
                                  f"{microbatches} microbatches, each of which needs a sample at least (an epoch's "
                                  "short last batch: drop it, DataLoader(drop_last=True); evaluate takes any size)")
        if not replica_share:
            global_batch = (values, targets)
            filled = not short_allowed  # an evaluation's short batch leaves some microbatches, or shares, empty
            values = [rt.replica_slice(v, filled) if b else v for v, b in zip(values, batched)]
            targets = rt.replica_slice(targets, filled) if targets is not None and targets.dim() > 0 else targets
        model_outputs = self._io.model_outputs
        # Hugging Face's num_items_in_batch (as its Trainer passes it): the model's loss is then a sum over the items
        # divided by the batch's count, not a mean: the engine adds the microbatches' up instead of weighing them.
        counted = loss is None and isinstance(inputs, collections.abc.Mapping) and \
            inputs.get("num_items_in_batch") is not None
        reduction = _smp.LossReduction.sum if counted or loss_reduction == "sum" else _smp.LossReduction.mean
        pieces = microbatches * rt.data_parallel_degree
        if loss is None:
            coefficient = _router_loss_coefficient(self._net)
            name = type(self._net).__name__

            def engine_loss(outputs, target):
                outputs = model_outputs(outputs)
                value = own_loss(outputs)
                if not counted:
                    return value
                # A mixture of experts adds its router's auxiliary loss, a mean over the microbatch's own tokens:
                # the token sum is added up, the auxiliary loss averaged over microbatches and replicas as without
                # num_items_in_batch.
                auxiliary = outputs.get("aux_loss") if isinstance(outputs, collections.abc.Mapping) else \
                    getattr(outputs, "aux_loss", None)
                if isinstance(auxiliary, torch.Tensor):
                    if coefficient is None:
                        raise ModelError(f"num_items_in_batch: {name}'s loss holds a router auxiliary loss (aux_loss) "
                                         "whose coefficient smp cannot find (router_aux_loss_coef or aux_loss_coef "
                                         "on the model or its config), to average it apart from the token sum; "
                                         "pass a loss function instead")
                    added = coefficient * auxiliary.to(value.device)
                    return value - added + added / pieces
                if isinstance(outputs, (tuple, list)) and coefficient and _routes_with_loss(self._net):
                    raise ModelError(f"num_items_in_batch: {name} returns a tuple (return_dict=False), where smp "
                                     "cannot find the router's auxiliary loss to average it apart from the token "
                                     "sum; let it return its output class, or pass a loss function")
                return value
        else:
            def engine_loss(outputs, target):
                return loss(model_outputs(outputs), target)
        # Which inputs are split was decided on the whole batch: a replica's share may have the size of an input
        # that is not the batch's.
        _routing.take()  # what profiling or an interrupted step counted
        if global_batch is not None:  # every rank must have been given the same one: the step compares them
            self._model.next_call_takes_share_of(*global_batch, batched)
        return values, targets, engine_loss, batched, reduction, model_outputs

    def train_step(self, inputs, targets=None, loss=None, keep_outputs=False, replica_share=False,
                   loss_reduction="mean"):
        """One step on the global batch (the same inputs on every rank; each replica takes its share): splits it
        into microbatches, runs the pipeline schedule, averages gradients over replicas. `inputs` as the sample:
        tensors whose first dimension is the batch's (that of `targets`, or without targets of the first input
        with one) are split, anything else goes to every microbatch as it is. `loss(output, target)` returns the
        mean loss of a microbatch, `output` as the model returns it; loss=None takes the loss the model computes
        itself (a Hugging Face model given labels: output.loss). Returns a StepResult: .loss (the global batch's
        mean loss, the same on every rank), .skipped, .seconds, and with keep_outputs=True .outputs: on the rank
        that runs the last stage, the model's outputs for this replica's share of the batch (runtime().replica_slice
        of it), in order and detached, as the model returns them with each tensor joined over the microbatches
        along its first dimension (0-dim ones give one value per microbatch); None on the other ranks.
        replica_share=True: the inputs and targets are already this replica's share (runtime().dp_rank's part of
        the global batch, every replica's the same size), so that each replica loads only its own data.
        loss_reduction="sum": `loss` returns its microbatch's part of the global batch's loss (a token sum divided by
        the global batch's token count, as Hugging Face's num_items_in_batch), and the microbatches' parts are added
        rather than averaged ("mean", the default, weighs each microbatch's mean by its samples)."""
        net = self._net
        if isinstance(net, torch.nn.Module) and not net.training and not self._said_eval_mode:
            self._said_eval_mode = True
            if runtime().rank == 0:
                print("smp: train_step with the model in eval mode (dropout off, batch norm on its running "
                      "statistics), as PyTorch trains it so; model.train() first to train in training mode "
                      "(from_pretrained returns a model in eval mode)", flush=True)
        if isinstance(net, torch.nn.Module) and not all(module.training for module in net.modules()):
            check_mode(net, self._evaluation_path(), "train_step")
        result = self._engine_step(self._model.train_step, inputs, targets, loss, keep_outputs, replica_share,
                                   "train_step", loss_reduction)
        if self.planned is not None and "measured_step_ms" not in self.planned:
            self._note_planned_step(result)
        return result

    def _note_planned_step(self, result):
        """A planned layout's measured step beside its prediction: the median of steps 2 to 5 (the first warms up),
        in .planned["measured_step_ms"], and printed by rank 0; where it divides the experts, the busiest rank's
        share of each layer's rows in those steps' exchanges beside the plan's (.planned["measured_routing"] and
        "routing", by experts path: this rank's layers)."""
        self._planned_steps.append(result.seconds * 1e3)
        ep = runtime().expert_parallel_degree
        if ep > 1 and len(self._planned_steps) > 1:
            for path, counts in _routing.exchanged(result.tokens_per_expert).items():
                self._planned_routing.setdefault(path, []).append(_routing.busiest_share(counts.tolist(), ep))
        if len(self._planned_steps) < 5:
            return
        middle = sorted(self._planned_steps[1:])[1:3]
        self.planned["measured_step_ms"] = sum(middle) / 2
        planned_routing = self.planned.get("routing") or {}
        measured = {path: sum(factors) / len(factors) for path, factors in self._planned_routing.items()}
        self.planned["measured_routing"] = {experts: measured[router] for experts in planned_routing
                                            if (router := _routing.counted_for(experts, measured)) is not None}
        if runtime().rank == 0:
            planned = self.planned
            print(f"smp: planned layout {planned['layout']}: train_step measured {planned['measured_step_ms']:.1f} ms "
                  f"(median of steps 2-5), predicted {planned['predicted_step_ms'] - planned['optimizer_ms']:.1f} ms "
                  f"(+{planned['optimizer_ms']:.1f} ms predicted for the optimizer's step)", flush=True)
            compared = planned["measured_routing"]
            if compared:
                print(f"smp: planned layout {planned['layout']}: routing measured: the busiest rank got "
                      f"{sum(compared.values()) / len(compared):.2f}x its even share of rows, planned "
                      f"{sum(planned_routing[path] for path in compared) / len(compared):.2f}x (a step's rows per "
                      f"expert-parallel group; mean over steps 2-5 and this rank's {len(compared)} experts layers)",
                      flush=True)

    def manual_seed(self, seed):
        """Starts the random numbers the model's modules draw in train_step and evaluate (dropout, stochastic depth)
        anew from `seed`, as torch.manual_seed does in one process (the engine draws them from a stream of its own,
        so torch.manual_seed between steps does not reach them). Every rank calls it with the same seed, between
        steps; each stage and replica then draws its own numbers from it."""
        self._model.seed_random_stream(int(seed) & 0xFFFFFFFFFFFFFFFF)

    def zero_grad(self, set_to_none=True):
        """Clears the gradients of this rank's parameters, as the DistributedOptimizer's zero_grad does."""
        self._model.zero_grad(set_to_none)

    def train(self, mode=True):
        """Training mode here and on the wrapped model's modules, whose own flags train_step follows module by
        module, as PyTorch does (a batch norm frozen with .eval() after this stays frozen); evaluate() and calling
        the model run every module in eval mode, whatever their flags."""
        super().train(mode)
        if isinstance(self._net, torch.nn.Module):
            self._net.train(mode)
        return self

    def _evaluation_path(self):
        """Where the model's eval-mode forward parts from its training capture (smp._evaluation_path), found at the
        first call that runs modules in eval mode, by every rank alike."""
        if not self._evaluation_checked:
            check = getattr(self._graph, "_check_evaluation", None)
            self._evaluation_differs = check() if check is not None else None
            self._evaluation_checked = True
        return self._evaluation_differs

    def evaluate(self, inputs, targets=None, loss=None, keep_outputs=False, replica_share=False,
                 loss_reduction="mean"):
        """The mean loss over the global batch without gradients (validation), taken like train_step by every rank:
        the schedule's forwards alone, keeping nothing for a backward, with the modules in eval mode (dropout off,
        batch norm on its running statistics) and back in training mode after. Returns .loss and .seconds, and
        .outputs as train_step does with keep_outputs=True; replica_share and loss_reduction as in train_step."""
        check_mode(self._net, self._evaluation_path(), "evaluate" if loss is not _no_loss else "calling the model")
        return self._engine_step(self._model.evaluate, inputs, targets, loss, keep_outputs, replica_share,
                                 "evaluate" if loss is not _no_loss else "calling the model", loss_reduction)

    def forward(self, *args, **kwargs):
        """Inference: the model's outputs for this replica's share of `inputs` (given as train_step takes them:
        positional or keyword), on the ranks running the last stage; None on the others. Every rank calls it."""
        if args and kwargs:
            raise TypeError("pass the inputs positionally or by keyword, not both (a dict of keyword inputs, as the "
                            "sample, takes both kinds)")
        # The net's own mode too: one handed over in eval mode (from_pretrained's) is for inference.
        net_training = self._net.training if isinstance(self._net, torch.nn.Module) else True
        if self.training and net_training and torch.is_grad_enabled():
            # A ported loop's `loss = criterion(model(x), y); loss.backward()` would fail later, on outputs that
            # have no graph (the stages ran on other ranks), or on None where no last stage runs.
            raise ModelError("calling the model runs its forwards for inference: the outputs have no gradients, on "
                             "the ranks running the last stage only. Train with model.train_step(inputs, targets, "
                             "loss_fn); for inference call model.eval() first, or call it under torch.no_grad()")
        inputs = kwargs if kwargs else (args[0] if len(args) == 1 else tuple(args))
        return self.evaluate(inputs, None, loss=_no_loss, keep_outputs=True).outputs

    @property
    def module(self):
        """The model given to DistributedModel, as DistributedDataParallel's .module (holding this rank's tensors
        only: see smp._materialize.release_other_stages)."""
        return self._net

    @property
    def device(self):
        return torch.device(runtime().device)

    @property
    def dtype(self):
        return next((p.dtype for p in self.parameters()), torch.get_default_dtype())

    def _apply(self, fn, recurse=True):
        # Module.to, .half, .double, .cuda, .cpu come here: the engine's tensors stay where the config put them.
        held = next((p for p in self.parameters()), None)
        if held is not None:
            probe = torch.empty(0, dtype=held.dtype, device=held.device)  # where fn would take it, copying nothing
            moved = fn(probe)
            if moved.dtype != probe.dtype or moved.device != probe.device:
                raise ValueError(f"a DistributedModel stays on the device and dtype its config gives "
                                 f"({probe.device}, {probe.dtype}; asked {moved.device}, {moved.dtype}): choose the "
                                 "device with the config's \"device\", mixed precision with \"bf16\" or \"fp16\", "
                                 "or convert the model before wrapping it")
        return self

    def compile(self, *args, **kwargs):
        raise NotImplementedError("smp runs each stage's modules as they are: torch.compile of a DistributedModel "
                                  "would compile nothing the engine runs (README: Not built yet)")

    def __deepcopy__(self, memo):
        # torch.optim.swa_utils.AveragedModel and timm's ModelEmaV2 copy the model; pickle failed on the engine.
        raise TypeError("a DistributedModel cannot be copied: it holds this rank's share of the model and the job's "
                        "communication. For an average of the weights (EMA, SWA) keep one of this rank's "
                        "model.state_dict() and update it after each optimizer.step(); to evaluate with it, "
                        "load_state_dict it in and the trained weights back after (README: averaged weights)")

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        net = self.__dict__.get("_net")
        if name == "config" and hasattr(net, "config"):
            return net.config  # a Hugging Face model's: read by training loops
        hints = {"generate": "generation runs token by token, which a pipeline does not; export the trained model "
                             "(smp.export_safetensors) and generate with it in one process",
                 "gradient_checkpointing_enable": "smp recomputes activations by its config: \"activation_"
                                                  "checkpointing\": true (or the stages or modules to recompute)",
                 "save_pretrained": f"this rank holds its stages only: {_materialize.SAVE_WHOLE_MODEL}",
                 "push_to_hub": "this rank holds its stages only: write the whole model with "
                                "smp.export_safetensors from a checkpoint, and push that directory",
                 "no_sync": "train_step accumulates over its microbatches and then averages over the replicas: "
                            "accumulate by raising \"microbatches\" (or call train_step again before "
                            "optimizer.step(), without zero_grad, each averaged apart)",
                 "require_backward_grad_sync": "train_step averages the gradients over the replicas in each step",
                 "backward": "train_step runs the backward itself (SMP's model.backward inside an smp.step "
                             "function): call model.train_step(inputs, targets, loss_fn)"}
        raise AttributeError(f"'DistributedModel' object has no attribute '{name}'" +
                             (f": {hints[name]}" if name in hints else ""))

    def extra_repr(self):
        return f"stages={list(self.stages)}, parameters={len(self._parameter_names)} of the model's on this rank"

    @staticmethod
    def _prefixed(prefix, name):
        return f"{prefix}.{name}" if prefix else name

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        """The wrapper, then the wrapped model's modules by their names in it (the names the parameters go by), so
        that fine-tuning's `for m in model.modules(): if isinstance(m, nn.BatchNorm2d): m.eval()` reaches the
        model's batch norms (the stages follow each module's flag), as it does through DistributedDataParallel.
        The modules of other ranks' stages hold meta tensors here (smp._materialize.release_other_stages): within a
        parent module's walk (memo given: it reads each module's own tensors) the wrapper stands alone, its
        tensors this rank's named_parameters()."""
        walked_by_parent = memo is not None
        memo = set() if memo is None else memo
        if self in memo:
            return
        if remove_duplicate:
            memo.add(self)
        yield prefix, self
        if walked_by_parent or not isinstance(self._net, torch.nn.Module):
            return
        for name, module in self._net.named_modules(memo, prefix, remove_duplicate):
            if module is not self._net:
                yield name, module

    def apply(self, fn):
        """fn on each of the wrapped model's modules (initialization, freezing), then on the wrapper; not a change
        of dtype or device (the engine's tensors stay where the config put them: see .to)."""
        held = [(p, p.dtype, p.device) for p in self.parameters()]
        if isinstance(self._net, torch.nn.Module):
            self._net.apply(fn)
        fn(self)
        moved = next((p for p, dtype, device in held if p.dtype != dtype or p.device != device), None)
        if moved is not None:
            raise ValueError("model.apply changed the dtype or device of the engine's parameters: a DistributedModel "
                             "stays on the device and dtype its config gives (choose the device with the config's "
                             "\"device\", mixed precision with \"bf16\" or \"fp16\")")
        return self

    def get_submodule(self, target):
        if not target or not isinstance(self._net, torch.nn.Module):
            return super().get_submodule(target)
        return self._net.get_submodule(target)

    def get_parameter(self, target):
        """This rank's parameter of that name in the full model (named_parameters' names)."""
        found = dict(self.named_parameters()).get(target)
        if found is None:
            raise AttributeError(f"this rank holds no parameter {target!r} (its stages {list(self.stages)}; "
                                 "named_parameters() lists what it holds)")
        return found

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """This rank's parameters by their names in the full model, in its order (the engine's tensors: no
        copies)."""
        tensors = self._model.named_parameters()
        for name in self._parameter_names:
            yield self._prefixed(prefix, name), tensors[name]

    def parameters(self, recurse=True):
        """This rank's parameters, the tensors the engine trains: build the optimizer over these."""
        for _, parameter in self.named_parameters():
            yield parameter

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        """This rank's buffers that are part of the model's state (batch norm's statistics; not non-persistent ones),
        by their names in the full model (the engine's tensors: no copies)."""
        tensors = self._model.named_buffers()
        for name in self._buffer_names:
            yield self._prefixed(prefix, name), tensors[name]

    def buffers(self, recurse=True):
        for _, buffer in self.named_buffers():
            yield buffer

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """This rank's parameters and persistent buffers by their names in the full model (a share of the model's
        state_dict: the other ranks hold the rest). A tied tensor is there under each of the model's names for it
        (transformer.wte.weight and lm_head.weight), as in the model's own state_dict."""
        if args:
            raise TypeError("state_dict takes keyword arguments only (destination, prefix, keep_vars)")
        rt = runtime()
        if not self._said_share and (rt.world_size > rt.data_parallel_degree or rt.expert_parallel_degree > 1):
            # Habits that would keep part of the model without a word: DDP's torch.save(model.state_dict()) on rank
            # 0, SMP's (whose state_dict() gathered the whole model) on the last stage's rank. Said on each rank
            # that calls it, once.
            object.__setattr__(self, "_said_share", True)
            warnings.warn(f"rank {rt.rank}: model.state_dict() holds this rank's share of the model (stages "
                          f"{list(self.stages)}); for the whole model save with smp.Checkpointer and export with "
                          "smp.export_safetensors or smp.export_checkpoint (local_state_dict() says the same "
                          "without this warning; said once)", stacklevel=2)
        return self.local_state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def local_state_dict(self, destination=None, prefix="", keep_vars=False):
        """This rank's share of the model's state_dict, as state_dict() gives it (SMP's name for it)."""
        state = collections.OrderedDict() if destination is None else destination
        for name, tensor in self._own_state():
            for key in (name, *self._aliases.get(name, ())):
                state[prefix + key] = tensor if keep_vars else tensor.detach()
        return state

    def _own_state(self):
        """(name, tensor) of this rank's parameters and persistent buffers, each once."""
        return itertools.chain(self.named_parameters(), self.named_buffers())

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Copies this rank's tensors from `state_dict` by name: the full model's (each rank takes its own, a
        tensor-parallel shard its part) or this rank's share. strict: every tensor of this rank must be there (missing_keys), and every key must be a
        tensor of the model (unexpected_keys; another rank's is not unexpected). Shapes are checked before anything
        is copied. Returns (missing_keys, unexpected_keys) as nn.Module's does."""
        if assign:
            raise ValueError("assign=True would put new tensors where the engine trains its own; smp copies into them")
        own = dict(self._own_state())
        given = {name: next((alias for alias in [name, *self._aliases.get(name, ())] if alias in state_dict), None)
                 for name in own}  # the key each of this rank's tensors loads from
        missing = [name for name, key in given.items() if key is None]
        unexpected = [name for name in state_dict if name not in own and name not in self._full_names]
        problems = []
        if strict and missing:
            problems.append(f"missing keys (this rank's): {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}")
        if strict and unexpected:
            problems.append(f"unexpected keys: {', '.join(unexpected[:5])}{', ...' if len(unexpected) > 5 else ''}")
        for name, tensor in own.items():
            shape = tuple(state_dict[given[name]].shape) if given[name] is not None else None
            if shape is not None and shape != tuple(tensor.shape) and shape != tp.whole_shape(tensor):
                problems.append(f"{name}: shape {shape} in the state_dict, {tp.whole_shape(tensor)} in the model")
        if problems:
            raise RuntimeError("Error(s) in loading state_dict for DistributedModel:\n\t" + "\n\t".join(problems))
        with torch.no_grad():
            for name, tensor in own.items():
                if given[name] is not None:
                    tensor.copy_(tp.local_part(tensor, state_dict[given[name]]))
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def load_parameters(self, path):
        """Copies this rank's parameters and buffers, by name, from a full-model file (smp.export_checkpoint) or
        safetensors (smp.export_safetensors' directory, a Hugging Face one, or one .safetensors file; only this
        rank's tensors are read). Every name and shape is checked before anything is copied."""
        self._model.load_parameters(os.fspath(path))

    def load_pretrained(self, path, key_map=None, strict=True):
        """Reads this rank's parameters (and the persistent buffers of its stages) from pretrained weights: a Hugging
        Face directory (model.safetensors, or shards with model.safetensors.index.json; read lazily, tensor by
        tensor) or a torch.save state dict file (memory-mapped), by the names of the model's state_dict. Every name
        and shape is checked before anything is copied (CheckpointError naming the tensor and the file). With a model
        built on the meta device no process ever holds more than its own stages. Returns how many tensors it read.

        A model whose names differ from the file's (a base wrapped with adapters: q_proj.base.weight for the file's
        q_proj.weight) gives key_map(name) -> the file's name, or None for a tensor the file does not hold;
        strict=False leaves the tensors the file lacks as initialized (LoRA's adapters)."""
        from ._pretrained import load_pretrained
        tensors = dict(self._model.named_parameters())
        names, stages = self._graph.node_names(), set(self.stages)
        local = {names[i] for i, stage in enumerate(self.stage_of_module) if stage in stages}
        for name, node in self._graph._captured.items():
            if name not in local:
                continue
            for buffer_name, buffer in node.named_buffers():
                if not buffer.is_meta and buffer_name in self._persistent_buffers:
                    tensors.setdefault(buffer_name, buffer)
        return load_pretrained(tensors, path, key_map, strict)

    @property
    def stages(self):
        """The pipeline stages this rank runs."""
        return self._model.stages

    @property
    def stage_of_module(self):
        return self._model.stage_of_module

    def partition_report(self):
        return self._model.partition_report()


# SageMaker SMP v1's keyword arguments, which a ported script passes on: what takes their place.
_SMP_V1_MODEL_OPTIONS = {
    "trace_device": "smp profiles each module on the config's \"device\" (a model built on the meta device is "
                    "profiled there)",
    "trace_execution_times": "smp times each module on the sample whenever there is more than one stage",
    "trace_memory_usage": "smp profiles each module's memory on the sample",
    "average_grads_across_microbatches": "train_step's loss is the mean over the microbatches and replicas (its "
                                         "gradients too); loss_reduction=\"sum\" for a token sum",
    "backward_passes_per_step": "call train_step again before optimizer.step() to accumulate, or raise "
                                "\"microbatches\"",
    "gradient_as_bucket_view": "the replicas' gradient buckets are smp's own",
    "broadcast_buffers": "each replica's buffers are replica 0's after every step",
    "overlapping_allreduce": "\"ddp\" overlaps the replicas' reduction with the backward",
}
_SMP_V1_OPTIMIZER_OPTIONS = {
    "static_loss_scale": "\"fp16\": true in the config scales the loss dynamically",
    "dynamic_loss_scale": "\"fp16\": true in the config scales the loss dynamically",
    "dynamic_loss_args": "\"fp16\": true in the config scales the loss dynamically",
}


def _refuse_smp_v1_options(what, given, known):
    if not given:
        return
    name = next(iter(given))
    if name in known:
        raise TypeError(f"{what}() takes no {name!r} (SageMaker SMP's): {known[name]}. README: Coming from "
                        "SageMaker SMP")
    raise TypeError(f"{what}() got an unexpected keyword argument {name!r}")


def _targets_as_rows(targets, loss, what):
    """Targets given as a tuple, list or dict of tensors (labels and a mask, as an SMP step function took them): the
    engine splits one tensor, every target tensor's rows side by side as bytes, so that the step compares their
    values across ranks as it does one tensor's and moves them to its device; the loss function is given each
    microbatch's rows of every one, in the structure given. A tensor or None as it is."""
    if targets is None or isinstance(targets, torch.Tensor):
        return targets, loss
    leaves, spec = torch.utils._pytree.tree_flatten(targets)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if not isinstance(targets, (tuple, list, dict)) or not tensors:
        raise ConfigError(f"{what}: targets of type {type(targets).__name__}: expected a tensor, or a tuple, list or "
                          "dict of tensors whose first dimension is the batch's")
    if loss is None or loss is _no_loss:
        raise ConfigError(f"{what}: targets as a {type(targets).__name__} need a loss function to take them (the "
                          "model computes its own loss from its inputs)")
    rows = tensors[0].shape[0] if tensors[0].dim() else None
    if any(tensor.dim() == 0 or tensor.shape[0] != rows for tensor in tensors):
        raise ConfigError(f"{what}: every tensor of the targets splits along its first dimension, the batch's: "
                          f"shapes {[tuple(tensor.shape) for tensor in tensors]}")
    if any(tensor.is_meta for tensor in tensors):
        raise ConfigError(f"{what}: the targets are on the meta device, which holds no values")
    device = tensors[0].device
    columns, places, start = [], {}, 0  # leaf index -> (dtype, a row's shape, first byte column, past its last)
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        row_bytes = leaf.detach().to(device).contiguous().reshape(rows, -1).view(torch.uint8)
        columns.append(row_bytes)
        places[index] = (leaf.dtype, tuple(leaf.shape[1:]), start, start + row_bytes.shape[1])
        start += row_bytes.shape[1]

    def loss_of_rows(outputs, packed):
        unpacked = list(leaves)
        for index, (dtype, shape, first, past) in places.items():
            unpacked[index] = packed[:, first:past].contiguous().view(dtype).reshape(packed.shape[0], *shape)
        return loss(outputs, torch.utils._pytree.tree_unflatten(unpacked, spec))

    return torch.cat(columns, dim=1), loss_of_rows


def _refuse_unscaled_half(rt, what):
    """torch.autocast(float16) around a step, as a DDP loop with GradScaler has it: the engine's backward would run
    without loss scaling (GradScaler cannot scale a loss the engine differentiates), float16 gradients underflowing
    to zero. The config's "fp16" scales them, dynamically, and casts as autocast does."""
    device_type = torch.device(rt.device).type
    if rt.config.fp16 or not torch.is_autocast_enabled(device_type) or \
            torch.get_autocast_dtype(device_type) != torch.float16:
        return
    raise ConfigError(f"{what} under torch.autocast(float16): the engine's backward would run without loss scaling, "
                      "which GradScaler cannot give it; set \"fp16\": true in the config (autocast and dynamic loss "
                      "scaling, by the engine) and drop torch.autocast and GradScaler, or use \"bf16\"")


def _router_loss_coefficient(net):
    """The weight a mixture of experts gives its router's auxiliary loss in its own loss: on the model (DBRX), its
    config (router_aux_loss_coef, JetMoE's aux_loss_coef), or its text config (vision-language models); None."""
    config = getattr(net, "config", None)
    for owner in (net, config, getattr(config, "text_config", None)):
        for key in ("router_aux_loss_coef", "aux_loss_coef"):
            value = getattr(owner, key, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return None


def _routes_with_loss(net):
    config = getattr(net, "config", None)
    return any(getattr(owner, "output_router_logits", False)
               for owner in (config, getattr(config, "text_config", None)))
