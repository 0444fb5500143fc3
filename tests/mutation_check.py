"""A mutation check of the tests: each mutant below is a small wrong change to fivefold's source that some test
must notice. `python tests/mutation_check.py [ID ...]` applies each one in a temporary git worktree of HEAD
(the checkout itself is never touched), runs the tests of its module with -x, and prints whether a test
failed ("killed") or none did ("SURVIVED"). Every mutant is killed, but one marked equivalent: it changes no
result, so no test can see it. tests/test_mutation_check.py keeps the list applicable to the source.

Each takes seconds to a few minutes on 2 cores; the whole list about an hour.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
TESTS = {  # the tests that cover each module
    "serve": "tests/test_serve_blocks.py tests/test_serve_scheduler.py tests/test_serve_engine.py tests/test_server.py "
             "tests/test_serve_fast_path.py tests/test_serve_lean_forward.py",
    "server": "tests/test_server.py",
    "quant": "tests/test_quant.py",
    "lora": "tests/test_lora.py tests/test_peft_interop.py tests/test_serve_lora.py tests/test_weights.py",
    "train": "tests/test_schedules.py tests/test_train.py",
    "data": "tests/test_data.py tests/test_sft.py",
    "ck": "tests/test_checkpoint.py tests/test_checkpoint_integrity.py",
    "tp": "tests/test_tensor_parallel.py",
    "dp": "tests/test_data_parallel.py",
    "zero": "tests/test_zero.py",
    "pp": "tests/test_pipeline.py",
    "cp": "tests/test_context_parallel.py",
    "moe": "tests/test_moe.py",
    "memory": "tests/test_memory_plan.py tests/test_memory_measured.py tests/test_recompute_layers.py",
    "flops": "tests/test_flops.py tests/test_memory_plan.py",
    "memory_pp": "tests/test_memory_plan.py tests/test_pipeline.py",
    "memory_zero": "tests/test_memory_plan.py tests/test_zero.py",
    "rules": "tests/test_layout_rules.py tests/test_config.py tests/test_bad_inputs.py tests/test_fp8.py "
             "tests/test_noise_scale.py",
    "speed": "tests/test_speed_model.py",
    "loss": "tests/test_chunked_loss.py",
    "ops": "tests/test_recompute_ops.py::test_tensor_parallel_memory_matches_the_plan",
}


class Mutant(NamedTuple):
    id: str
    path: str
    tests: str  # a key of TESTS
    old: str  # occurs exactly once in path
    new: str
    expected: str = "killed"  # or "equivalent": no result changes (GPTQ's update of a column already read)


MUTANTS = [Mutant(*m) for m in [
    ('S1', 'fivefold/serve/sampling.py', 'serve',
     'drop = rank[None] >= k[:, None]',
     'drop = rank[None] > k[:, None]'),
    ('S2', 'fivefold/serve/sampling.py', 'serve',
     'probs < min_p[:, None] * probs.max',
     'probs <= min_p[:, None] * probs.max'),
    ('S3', 'fivefold/serve/sampling.py', 'serve',
     'torch.from_numpy(presence).to(device)[:, None] * (counts > 0))',
     'torch.from_numpy(presence).to(device)[:, None] * counts)'),
    ('S4', 'fivefold/serve/sampling.py', 'serve',
     'sub.scatter_(1, seen, torch.where(picked > 0, picked / penalty, picked * penalty))',
     'sub.scatter_(1, seen, picked / penalty)'),
    ('S5', 'fivefold/serve/sampling.py', 'serve',
     'seen, _ = _padded([sorted(set(requests[i].prompt_ids) | set(requests[i].output_ids))',
     'seen, _ = _padded([sorted(set(requests[i].output_ids) or {0})'),
    ('S6', 'fivefold/serve/sampling.py', 'serve',
     '(u * cdf[:, -1])[:, None], right=True)',
     '(u * cdf[:, -1])[:, None], right=False)'),
    ('S7', 'fivefold/serve/sampling.py', 'serve',
     'logits = logits / temperature[:, None]',
     'logits = logits / temperature[:, None].sqrt()'),
    ('S8', 'fivefold/serve/sampling.py', 'serve',
     'counts = torch.zeros_like(sub).scatter_add_(1, out, valid.to(sub.dtype))',
     'counts = torch.zeros_like(sub).scatter_add_(1, out, torch.ones_like(valid, dtype=sub.dtype))'),
    ('S9', 'fivefold/serve/sampling.py', 'serve',
     'raw = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None',
     'raw = None'),
    ('S10', 'fivefold/serve/sampling.py', 'serve',
     'logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)',
     'logits -= params.frequency_penalty * counts + params.presence_penalty * counts'),
    ('B1', 'fivefold/serve/blocks.py', 'serve',
     'for i in range((len(tokens) - 1) // bs):',
     'for i in range(len(tokens) // bs):'),
    ('B2', 'fivefold/serve/blocks.py', 'serve',
     '                if self.hash_of[b] is None:\n                    self.free.move_to_end(b, last=False)\n',
     ''),
    ('B3', 'fivefold/serve/blocks.py', 'serve',
     'for b in reversed(seq.block_table):',
     'for b in seq.block_table:'),
    ('B4', 'fivefold/serve/blocks.py', 'serve',
     'if fresh + revived + reserve > self.num_free:',
     'if fresh + reserve > self.num_free:'),
    ('B5', 'fivefold/serve/blocks.py', 'serve',
     '            del self.cached[h]\n            self.hash_of[block] = None\n',
     '            self.hash_of[block] = None\n'),
    ('B6', 'fivefold/serve/blocks.py', 'serve',
     'if self.prefix_cache and h not in self.cached:',
     'if self.prefix_cache:'),
    ('B7', 'fivefold/serve/blocks.py', 'serve',
     'self.hit_tokens += computed',
     'self.hit_tokens += len(hits)'),
    ('C1', 'fivefold/serve/scheduler.py', 'serve',
     'victim = self.running[-1]',
     'victim = self.running[0]'),
    ('C2', 'fivefold/serve/scheduler.py', 'serve',
     'self.waiting.appendleft(seq)',
     'self.waiting.append(seq)'),
    ('C3', 'fivefold/serve/scheduler.py', 'serve',
     '                scheduled.append((seq, n))\n                budget -= n\n',
     '                scheduled.append((seq, n))\n'),
    ('C4', 'fivefold/serve/scheduler.py', 'serve',
     'len(self.running) < self.max_num_seqs',
     'len(self.running) <= self.max_num_seqs'),
    ('C5', 'fivefold/serve/scheduler.py', 'serve',
     'reserve=self.reserve if self.running else 0',
     'reserve=0'),
    ('C6', 'fivefold/serve/scheduler.py', 'serve',
     'while self.waiting and budget and not preempted and',
     'while self.waiting and budget and'),
    ('P1', 'fivefold/serve/protocol.py', 'server',
     'top_k=0 if body.top_k == -1 else body.top_k',
     'top_k=max(body.top_k, 0)'),
    ('P2', 'fivefold/serve/protocol.py', 'server',
     '        offsets.append(offset)\n        offset += len(token)',
     '        offset += len(token)\n        offsets.append(offset)'),
    ('P3', 'fivefold/serve/protocol.py', 'server',
     'self.hold = max(map(len, stop), default=1) - 1',
     'self.hold = max(0, max(map(len, stop), default=1) - 2)'),
    ('P4', 'fivefold/serve/protocol.py', 'server',
     '        if len(now) > len(before) and not now.endswith("\\ufffd"):',
     '        if len(now) > len(before):'),
    ('P5', 'fivefold/serve/protocol.py', 'server',
     '        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")',
     '        pass'),
    ('Q1', 'fivefold/quant/formats.py', 'quant',
     '    half = torch.where(half.float() < scale, (half.view(torch.int16) + 1).view(torch.float16), half)\n',
     ''),
    ('Q2', 'fivefold/quant/formats.py', 'quant',
     'zero = torch.round(-lo / scale).clamp(0, INT4_MAX)',
     'zero = torch.floor(-lo / scale).clamp(0, INT4_MAX)'),
    ('Q3', 'fivefold/quant/formats.py', 'quant',
     'scale = w.abs().amax(dim=1, keepdim=True) / INT8_MAX',
     'scale = w.abs().amax(dim=1, keepdim=True) / 128'),
    ('Q4', 'fivefold/quant/gptq.py', 'quant',
     '            W1[i:].addr_(U1[i, i:], err[i], alpha=-1)',
     '            W1[i + 1:].addr_(U1[i, i + 1:], err[i], alpha=-1)', "equivalent"),
    ('Q5', 'fivefold/quant/gptq.py', 'quant',
     '    diag += damp * diag.mean()',
     '    diag += damp'),
    ('Q6', 'fivefold/quant/gptq.py', 'quant',
     '                m.weight.data = qw.dequantize(m.weight.dtype)  # the next blocks see this block quantized\n',
     ''),
    ('Q7', 'fivefold/quant/gptq.py', 'quant',
     '    W[dead] = 0\n',
     ''),
    ('Q8', 'fivefold/quant/gptq.py', 'quant',
     '                    group = torch.cat([group, W[i2:col + g] - u[i1:col, i2:col + g].T @ err[:i]])',
     '                    group = torch.cat([group, W[i2:col + g]])'),
    ('L1', 'fivefold/finetune/lora.py', 'lora',
     'bound = 1.0 / math.sqrt(shape[1])',
     'bound = 1.0 / math.sqrt(shape[0])'),
    ('L2', 'fivefold/finetune/lora.py', 'lora',
     '            module.lora_A.weight.register_hook(all_reduce_hook(tp_group))\n',
     ''),
    ('L3', 'fivefold/finetune/lora.py', 'lora',
     '                module.lora_B.weight.register_hook(all_reduce_hook(tp_group))\n',
     ''),
    ('L4', 'fivefold/finetune/lora.py', 'lora',
     'delta = module.lora_B.weight.float() @ module.lora_A.weight.float() * lora.scaling',
     'delta = module.lora_B.weight.float() @ module.lora_A.weight.float()'),
    ('L5', 'fivefold/finetune/lora.py', 'lora',
     'x = F.dropout(x, self.dropout, module.training)',
     'x = F.dropout(x, self.dropout, True)'),
    ('L6', 'fivefold/finetune/lora.py', 'lora',
     '    for p in model.parameters():\n        p.requires_grad_(False)\n',
     ''),
    ('T1', 'fivefold/train/optim.py', 'train',
     'coef = (grad_clip / (norm + 1e-6)).clamp(max=1.0)',
     'coef = (grad_clip / (norm + 1e-6))'),
    ('T2', 'fivefold/train/optim.py', 'train',
     'floor = peak * cfg.min_lr_ratio',
     'floor = 0.0 * cfg.min_lr_ratio'),
    ('T3', 'fivefold/train/optim.py', 'train',
     'if tokens_seen >= threshold:',
     'if tokens_seen > threshold:'),
    ('D1', 'fivefold/data/dataset.py', 'data',
     'return (self.store.num_tokens - 1) // self.seq_len',
     'return self.store.num_tokens // self.seq_len'),
    ('D2', 'fivefold/data/dataset.py', 'data',
     'k = bisect.bisect_right(self._starts, start) - 1',
     'k = bisect.bisect_left(self._starts, start) - 1'),
    ('D3', 'fivefold/data/dataset.py', 'data',
     'rng = np.random.default_rng([self.seed % 2**64, self.epoch])',
     'rng = np.random.default_rng([self.seed % 2**64, 0])'),
    ('D4', 'fivefold/data/dataset.py', 'data',
     '            if self.position == self.num_items:\n                self.epoch, self.position = self.epoch + 1, 0',
     '            if self.position == self.num_items:\n                self.position = 0'),
    ('K1', 'fivefold/checkpoint/store.py', 'ck',
     '        elif file_entry(path)[HASH_NAME] != expected[HASH_NAME]:',
     '        elif False:'),
    ('K2', 'fivefold/checkpoint/store.py', 'ck',
     'for stale in list_checkpoints(root)[:-keep]:',
     'for stale in list_checkpoints(root)[:-keep - 1]:'),
    ('K3', 'fivefold/checkpoint/store.py', 'ck',
     '        if target in found:\n',
     '        if False:\n'),
    ('K4', 'fivefold/checkpoint/store.py', 'ck',
     '        if pid.isdigit() and not _pid_alive(int(pid)):',
     '        if pid.isdigit():'),
    ('K5', 'fivefold/checkpoint/store.py', 'ck',
     '    if damaged and all(_unverifiable(found) for _, found in damaged):',
     '    if damaged and any(_unverifiable(found) for _, found in damaged):'),

    # tensor parallelism and its collectives
    ('TP1', 'fivefold/parallel/collectives.py', 'tp',
     '        dist.all_reduce(grad, group=ctx.group)\n        return grad, None\n',
     '        return grad, None\n'),
    ('TP2', 'fivefold/parallel/tensor_parallel.py', 'tp',
     'grad_logits *= (grad * keep)[:, None]',
     'grad_logits *= grad[:, None]'),
    ('TP3', 'fivefold/parallel/tensor_parallel.py', 'tp',
     'norms = [*(m for block in model.layers for m in (block.attn_norm, block.mlp_norm)), model.norm]',
     'norms = [*(m for block in model.layers for m in (block.attn_norm, block.mlp_norm))]'),
    ('TP4', 'fivefold/parallel/tensor_parallel.py', 'tp',
     '    params += [m.bias for m in model.modules() if isinstance(m, RowParallelLinear) and m.bias is not None]\n',
     ''),
    ('TP5', 'fivefold/parallel/tensor_parallel.py', 'tp',
     '        x_full.untyped_storage().resize_(0)\n',
     ''),
    ('TP6', 'fivefold/parallel/collectives.py', 'lora',
     'x = x.clone(memory_format=torch.contiguous_format) if copy else x.contiguous()',
     'x = x.contiguous()'),
    ('TP7', 'fivefold/parallel/tensor_parallel.py', 'moe',
     '    experts.register_forward_pre_hook(lambda module, args: (CopyToTP.apply(args[0], group), *args[1:]))\n',
     ''),
    # data parallelism and ZeRO
    ('DP1', 'fivefold/parallel/data_parallel.py', 'dp',
     '        if not self.sync or not self.overlap:\n            return\n',
     '        if not self.overlap:\n            return\n'),
    ('DP2', 'fivefold/parallel/data_parallel.py', 'dp',
     '                if count:\n                    self.reduced[p]',
     '                if True:\n                    self.reduced[p]'),
    ('ZR1', 'fivefold/parallel/zero.py', 'zero',
     '                bucket.grad_shard += bucket.output',
     '                bucket.grad_shard.copy_(bucket.output)'),
    ('ZR2', 'fivefold/parallel/zero.py', 'zero',
     '                if local.data_ptr() != self.masters[i].data_ptr():\n                    local.copy_(self.masters[i])\n',
     '                pass\n'),
    ('ZR3', 'fivefold/parallel/zero.py', 'zero',
     '                bucket.grad_shard = None  # stage 1',
     '                pass  # stage 1'),
    ('ZR4', 'fivefold/parallel/zero.py', 'zero',
     '        if not in_backward():\n            self._gather(unit + 1, wait=False)',
     '        if not in_backward():\n            self._gather(unit + 2, wait=False)'),
    # gradient norm across model-parallel ranks
    ('GN1', 'fivefold/train/optim.py', 'tp',
     '            parts[1::2] = tp_parts\n',
     ''),
    ('GN2', 'fivefold/train/optim.py', 'pp',
     '        if not counted:\n            self.uncounted.add(i)\n',
     ''),
    ('GN3', 'fivefold/train/optim.py', 'moe',
     '            dist.all_reduce(parts[2:4], group=self.ep_group)',
     '            dist.all_reduce(parts[3:4], group=self.ep_group)'),
    # context parallelism
    ('CP1', 'fivefold/parallel/context_parallel.py', 'cp',
     '                if bias is not None:  # the kernel gives a query with no key of its document here lse 0\n'
     '                    block_lse = block_lse.masked_fill(~allowed.any(-1), float("-inf"))\n',
     ''),
    ('CP2', 'fivefold/parallel/context_parallel.py', 'cp',
     '    return tuple(t[:, :, cols].repeat_interleave(groups, 1) if groups > 1 else t[:, :, cols] for t in kv)',
     '    return tuple(t[:, :, cols].repeat(1, groups, 1, 1) if groups > 1 else t[:, :, cols] for t in kv)'),
    ('CP3', 'fivefold/parallel/context_parallel.py', 'moe',
     '        moe.distribute(sum_over_sequence=lambda t: _summed(t, group))',
     '        pass'),
    ('CP4', 'fivefold/parallel/context_parallel.py', 'cp',
     'causal = zigzag_positions(seq, cp, rank, device)[:, None] >= zigzag_positions(seq, cp, source, device)[None, :]',
     'causal = zigzag_positions(seq, cp, rank, device)[:, None] > zigzag_positions(seq, cp, source, device)[None, :]'),
    # expert parallelism
    ('EP1', 'fivefold/parallel/expert_parallel.py', 'moe',
     '            members = [int(ranks[g * ep + e, c, t]) for g in range(dp // ep) for c in range(cp)]',
     '            members = [int(ranks[g * ep + e, 0, t]) for g in range(dp // ep)]'),
    # pipeline
    ('PP1', 'fivefold/parallel/pipeline_schedules.py', 'pp',
     '    warmup = min(pp - rank - 1, m)',
     '    warmup = min(pp - rank, m)'),
    # pipeline schedules (the runtime and the planner run the same lists)
    ('PP2', 'fivefold/parallel/pipeline_schedules.py', 'pp',
     '    return out + [Action("B", i) for i in range(m - warmup, m)]\n\n\ndef _interleaved',
     '    return out + [Action("B", i) for i in reversed(range(m - warmup, m))]\n\n\ndef _interleaved'),
    ('PP3', 'fivefold/parallel/pipeline_schedules.py', 'pp',
     '    warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, total)',
     '    warmup = min(2 * (pp - rank - 1) + (v - 1) * pp + 1, total)'),
    ('PP4', 'fivefold/parallel/pipeline_schedules.py', 'pp',
     'if ready is not None and ready <= t and not (nxt.kind == "F" and unfinished[r] >= pp):',
     'if ready is not None and ready <= t:'),
    ('PP5', 'fivefold/parallel/pipeline_schedules.py', 'memory_pp',
     '    after_b = pending_w if any(a.kind == "W" for a in actions) else 0.0',
     '    after_b = 0.0'),
    # parameter and FLOP counts, stage partition
    ('MF1', 'fivefold/memory/formulas.py', 'flops',
     'qkv_bias = (cfg.q_size + 2 * cfg.kv_size) if',
     'qkv_bias = (cfg.q_size + cfg.kv_size) if'),
    ('MF2', 'fivefold/memory/formulas.py', 'memory',
     '        if not cfg.tie_embeddings or not first_stage:',
     '        if not cfg.tie_embeddings:'),
    ('MF3', 'fivefold/memory/formulas.py', 'flops',
     'forward = 2 * matmul_params(cfg) + 4 * cfg.num_layers * seq_len * cfg.q_size',
     'forward = 2 * matmul_params(cfg) + 2 * cfg.num_layers * seq_len * cfg.q_size'),
    ('MF4', 'fivefold/memory/formulas.py', 'pp',
     'counts = [base + (i < extra) for i in range(stages)]',
     'counts = [base + (i >= stages - extra) for i in range(stages)]'),
    ('MF5', 'fivefold/memory/formulas.py', 'memory',
     '        chunks = min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v)',
     '        chunks = min(2 * (pp - stage - 1) + (v - 1) * pp, m * v)'),
    ('MF6', 'fivefold/memory/formulas.py', 'memory',
     '    return name.endswith(".bias") or "embed" in name or "norm" in name',
     '    return name.endswith(".bias") or "embed" in name'),
    ('MF7', 'fivefold/memory/formulas.py', 'memory',
     '        if groups and total + size <= budget:',
     '        if groups and total + size < budget:'),
    # the memory plan
    ('MP1', 'fivefold/memory/plan.py', 'memory_pp',
     '    kept = replay.saved_bytes + (d.p * d.bsh if not last else 0.0)',
     '    kept = replay.saved_bytes'),
    ('MP2', 'fivefold/memory/plan.py', 'memory_zero',
     '            published += bpp.parameters * (dp + 1) * size',
     '            published += bpp.parameters * dp * size'),
    ('MP3', 'fivefold/memory/plan.py', 'memory_zero',
     'gather_forward, gather = gather_root + 2 * gathered, gather_root + 2 * gathered + layer',
     'gather_forward, gather = gather_root + gathered, gather_root + gathered + layer'),
    ('MP4', 'fivefold/memory/plan.py', 'memory',
     '        return math.ceil(count / dp) if zero >= from_stage else count',
     '        return math.ceil(count / dp) if zero > from_stage else count'),
    ('MP5', 'fivefold/memory/plan.py', 'memory',
     '    elif t.grad_accum > 1:\n        held_grads = memory["gradients"]\n',
     ''),
    ('MA1', 'fivefold/memory/activations.py', 'memory',
     '        r.save(act, up, *([prod] if down_input and not d.fp8 else []))',
     '        r.save(up, *([prod] if down_input and not d.fp8 else []))'),
    ('MA2', 'fivefold/memory/activations.py', 'memory',
     '    rsqrt = r.alloc(4 * d.bs)  # saved by rsqrt and by the mul\n    save(rsqrt)\n',
     '    rsqrt = r.alloc(4 * d.bs)  # saved by rsqrt and by the mul\n'),
    ('MA3', 'fivefold/memory/plan.py', 'memory',
     'labels_copy=t.micro_batch_size > 1 and not cfg.data.sft and par.cp == 1)',
     'labels_copy=False)'),
    ('MP6', 'fivefold/memory/plan.py', 'memory',
     '    loss_saved = saved_end - (labels_copy_bytes(d) if last else 0.0)',
     '    loss_saved = saved_end'),
    ('MA4', 'fivefold/memory/activations.py', 'tp',
     '            r.save(r.alloc(9 * d.b * d.s))',
     '            pass'),
    ('MA5', 'fivefold/memory/activations.py', 'tp',
     '        if d.vocab_parallel:\n            _vocab_parallel_loss(r, d)\n',
     ''),
    ('MA6', 'fivefold/memory/activations.py', 'memory',
     '    r.save(keep, local, mine)\n',
     ''),
    ('MA7', 'fivefold/memory/activations.py', 'loss',
     '    scatter = (whole if d.b > 1 else 0) + d.rep * whole',
     '    scatter = 0.0'),
    ('MA8', 'fivefold/memory/activations.py', 'ops',
     '            return sum(n for taken, at, n in alone.released if taken > alone.last_save and at <= upto)',
     '            return 0.0'),
    ('MA9', 'fivefold/memory/activations.py', 'memory',
     '            return sum(n for taken, n in alone.taken if after < taken <= alone.last_save)',
     '            return 0.0'),
    ('MP7', 'fivefold/memory/plan.py', 'memory',
     'parts["fp8_attention"]) + mlp_grad + core_grad,',
     'parts["fp8_attention"]) + mlp_grad,'),
    # layout rules: a layout the trainer cannot run must be refused before any process starts
    ('R1', 'fivefold/parallel/rules.py', 'rules',
     '    if p.pp > 1 and p.zero >= 2 and p.dp > 1:',
     '    if p.pp > 1 and p.zero >= 3 and p.dp > 1:'),
    ('R2', 'fivefold/parallel/rules.py', 'rules',
     '    return cfg.parallel.zero >= 2 and cfg.parallel.dp * cfg.parallel.cp > 1',
     '    return cfg.parallel.zero >= 2 and cfg.parallel.dp > 1'),
    ('R3', 'fivefold/parallel/rules.py', 'rules',
     '    bad = {key: n for key, n in fp8_widths(cfg.model).items() if n % 16}',
     '    bad = {key: n for key, n in fp8_widths(cfg.model).items() if n % 8}'),
    ('R4', 'fivefold/parallel/rules.py', 'rules',
     '            if leading == 0 or any(a.mb == 0 for _, a in work[leading:]):',
     '            if leading == 0:'),
    # the step-time model
    ('SP1', 'fivefold/planner/speed.py', 'speed',
     '    replays = 1 if cfg.train.recompute in ("full", "ops") else 0',
     '    replays = 1 if cfg.train.recompute == "full" else 0'),
    ('SP2', 'fivefold/planner/speed.py', 'speed',
     'seconds - hw.overlap * window)',
     'seconds - window)'),
    ('SP3', 'fivefold/planner/speed.py', 'speed',
     '    seconds = (local / (p.dp if p.zero >= 1 else 1)) * optimizer_bytes_per_param(cfg) / costs.bandwidth',
     '    seconds = local * optimizer_bytes_per_param(cfg) / costs.bandwidth'),
]]

def run(mutant: Mutant, tree: Path) -> str:
    """Apply `mutant` in `tree`, run its tests, restore the file; the verdict and the first failure."""
    path = tree / mutant.path
    source = path.read_text()
    path.write_text(source.replace(mutant.old, mutant.new, 1))
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               *TESTS[mutant.tests].split()], cwd=tree, capture_output=True, text=True,
                              timeout=1800, env={**os.environ, "PYTHONPATH": str(tree)})
    except subprocess.TimeoutExpired:
        return "killed (timed out)"
    finally:
        path.write_text(source)
    if done.returncode == 0:
        return "SURVIVED"
    failed = next((line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))), "")
    return f"killed  {failed[:150]}"


def main(ids: list[str]) -> int:
    chosen = [m for m in MUTANTS if not ids or m.id in ids]
    surprises = 0
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), "HEAD"], cwd=ROOT, check=True)
        try:
            for mutant in chosen:
                start = time.perf_counter()
                verdict = run(mutant, tree)
                surprises += verdict.startswith("SURVIVED") != (mutant.expected == "equivalent")
                print(f"{mutant.id:4} {mutant.path:34} {verdict}  ({time.perf_counter() - start:.0f} s)", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    print(f"{len(chosen)} mutants, {surprises} not as expected")
    return 1 if surprises else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
