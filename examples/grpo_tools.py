"""GRPO with a calculator tool: multi-turn rollouts (rlhfkit.multiturn), one file, the loop in plain sight.

    python examples/grpo_tools.py --model /tmp/smollm2-hf                    # GPU: a vLLM engine in-process
    python examples/grpo_tools.py --model /tmp/smollm2-hf --rollouts endpoint  # agent code over the OpenAI API
    python examples/grpo_tools.py --device cpu --tiny true                   # CPU smoke run: HF engine, tiny model

One step: conversations (the model writes <tool_call>{"name": "calculator", ...}</tool_call>, the tool's result
comes back as the next user message with loss mask 0, up to --max-turns turns) -> arithmetic reward on the final
answer -> make_experience (GRPO group advantages; observation tokens carry no loss) -> PPO-clip + k3 KL over
minibatches -> AdamW -> the new weights into the engine. The prompt shows two worked tool calls (a 135M model
never writes the call format unprompted). Conversations come either from ``generate_trajectories`` (``--rollouts
engine``: failed trajectories retried, a group with a member that still fails dropped whole) or from plain agent code
that only speaks OpenAI's chat API against ``rlhfkit.openai_endpoint`` (``--rollouts endpoint``: each conversation is
one session, turned into one rollout token for token by ``session_to_rollout``). Writes ``metrics.jsonl`` under
``--out``.
"""

from __future__ import annotations

import copy
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfkit.data import ArithmeticTask, PromptDatasetConfig, arithmetic_accuracy, arithmetic_reward, prompt_batch
from rlhfkit.engines import SamplingConfig
from rlhfkit.experience import (
    ExperienceConfig,
    engine_token_logprobs,
    iterate_minibatches,
    make_experience,
    select_experience,
)
from rlhfkit.losses import kl_loss, model_logprobs, policy_loss
from rlhfkit.multiturn import (
    Action,
    MultiTurnConfig,
    ToolEnvironment,
    ToolEnvironmentConfig,
    calculator,
    generate_trajectories,
    trainable_rollouts,
    trajectory_stats,
)
from rlhfkit.openai_endpoint import OpenAIEndpoint, OpenAIEndpointConfig, session_to_rollout
from rlhfkit.options import parse_options
from rlhfkit.packing import global_counts, partition_by_token_budget, register_varlen_attention
from rlhfkit.rewards import apply_reward_function, rollout_texts
from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model

SYSTEM = ('You can use a calculator. To call it, write <tool_call>{"name": "calculator", "arguments": '
          '{"expression": "12 * 34"}}</tool_call> and stop; its result comes back as <tool_response>. '
          "Then answer with the number only.")
DEMOS = (("12 * 34", "408"), ("250 + 77", "327"))  # worked examples shown in every prompt
TOOLS = {"calculator": calculator}


def conversation(question: str) -> list[dict]:
    """The chat a prompt starts from: the system message, the worked examples (question, tool call, tool response,
    answer), then the question."""
    messages = [{"role": "system", "content": SYSTEM}]
    for expression, value in DEMOS:
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        messages += [{"role": "user", "content": f"What is {expression}?"},
                     {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                     {"role": "user", "content": f"<tool_response>{value}</tool_response>"},
                     {"role": "assistant", "content": value}]
    return messages + [{"role": "user", "content": question}]


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str | None = None  # HF folder (SmolLM2 from examples/convert_smollm2.py); CPU: a tiny model is built
    out: str = "runs/grpo_tools"  # folder the run writes its metrics (and a CPU run its tiny model) to
    device: str = "cuda"  # "cuda" or "cpu"
    engine: str = "vllm"  # "vllm" (GPU) or "hf" (any device); --device cpu always uses "hf"
    rollouts: str = "engine"  # "engine": generate_trajectories; "endpoint": agent code over the OpenAI chat API
    steps: int = 100  # training steps
    prompts_per_step: int = 16  # prompts per step
    samples_per_prompt: int = 8  # samples per prompt (the group GRPO's advantage compares)
    max_new_tokens: int = 64  # per turn
    max_turns: int = 3  # most model turns per conversation
    max_total_tokens: int = 768  # prompt (with the worked examples) + every turn
    max_value: int = 999  # operands in [0, max_value]: products a small model cannot do in its head
    lr: float = 1e-6  # the policy's learning rate
    kl_coef: float = 0.001  # weight of the KL term to the reference
    temperature: float = 1.0  # sampling temperature (the log-probs use the same)
    tiny: bool = False  # smoke run: 2 steps of a few short conversations


CLIP, MINIBATCHES, MICRO_BATCH_TOKENS, SEED = 0.2, 2, 8192, 0


def observation_template(tokenizer) -> str:
    """A tool result as the next user message in the model's own chat format, opening the assistant's next turn:
    the chat template rendered with and without the message, the difference kept (no format hard-coded here). A
    turn the engine ended with the end-of-turn token has sampled that token, so only what the template puts after
    it (ChatML: a newline) comes first."""
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"}]
    message = {"role": "user", "content": "<tool_response>{result}</tool_response>"}
    before = tokenizer.apply_chat_template(chat, tokenize=False)
    after = tokenizer.apply_chat_template(chat + [message], tokenize=False, add_generation_prompt=True)
    assert after.startswith(before), "the chat template renders a prefix differently; write the template by hand"
    end_of_turn = before[before.rindex("A") + 1:]  # ChatML: "<|im_end|>\n"
    sampled_end = tokenizer.eos_token or ""
    lead = end_of_turn[len(sampled_end):] if sampled_end and end_of_turn.startswith(sampled_end) else ""
    return lead + after[len(before):]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


def agent(url: str, question: str, session: str, options: Options) -> dict[str, int]:
    """Agent code that knows only OpenAI's chat API: ask, run the calculator calls of the answer, send the results
    back as the next message, until an answer without a call or the turn / context limit."""
    messages, stats = conversation(question), {"turns": 0, "tool_calls": 0, "tool_errors": 0}
    tools = ToolEnvironment(TOOLS, ToolEnvironmentConfig(observation_template="<tool_response>{result}</tool_response>"))
    for turn in range(options.max_turns):
        body = {"model": "policy", "messages": messages, "max_tokens": options.max_new_tokens,
                "temperature": options.temperature, "user": session}
        try:
            answer = post(f"{url}/chat/completions", body)
        except urllib.error.HTTPError as error:
            if error.code == 400 and stats["turns"]:  # context_length_exceeded: no room for another turn
                break
            raise
        stats["turns"] += 1
        message = answer["choices"][0]["message"]
        messages.append(message)  # unchanged: the endpoint then continues the session token for token
        # the library's tool environment parses and runs the calls; its observation is the next message's text
        result = tools.step(Action(text=message["content"], token_ids=(), turn=turn, finish_reason="stop"))
        stats["tool_calls"] += result.num_tool_calls
        stats["tool_errors"] += result.num_tool_errors
        if result.done:
            break
        messages.append({"role": "user", "content": result.observation})
    return stats


def load(options: Options):
    path = options.model or str(build_tiny_model(Path(options.out) / "tiny_model",
                                                 TinyModelConfig(hidden_size=64, num_layers=2, seed=SEED),
                                                 exist_ok=True))
    tokenizer = AutoTokenizer.from_pretrained(path)
    # packed sequences attend only within themselves (rlhfkit.packing's varlen attention), never a dense T x T mask
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  attn_implementation=register_varlen_attention()).to(options.device)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if options.engine == "vllm" and options.device != "cpu":
        from rlhfkit.engines.vllm import VLLMEngine, VLLMEngineConfig

        engine = VLLMEngine(VLLMEngineConfig(model=path, gpu_memory_utilization=0.35, seed=SEED, dtype="float32",
                                             max_model_len=options.max_total_tokens + options.max_new_tokens))
    else:
        from rlhfkit.engines.hf import HFEngine

        engine = HFEngine.from_model(copy.deepcopy(policy).eval(), tokenizer=tokenizer, seed=SEED)
    return tokenizer, policy, reference, engine


def endpoint_rollouts(endpoint, records: list[dict], options: Options, step: int):
    """Every conversation of the step run by :func:`agent` at once (the endpoint batches concurrent requests into
    engine calls); each session becomes one rollout; a group with a failed conversation is dropped whole."""
    jobs = [(i, j, f"step{step}-prompt{i}-sample{j}") for i in range(len(records))
            for j in range(options.samples_per_prompt)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(agent, endpoint.url, records[i]["prompt"], session, options) for i, _, session in jobs]
    outcomes = [future.exception() or future.result() for future in futures]
    failed_groups = {i for (i, _, _), outcome in zip(jobs, outcomes) if isinstance(outcome, BaseException)}
    rollouts, done = [], [o for o in outcomes if not isinstance(o, BaseException)]
    for i, j, session in jobs:
        if session not in endpoint.session_ids():
            continue
        history = endpoint.pop_records(session)
        if i not in failed_groups:
            rollouts.append(session_to_rollout(history, prompt_index=i, sample_index=j, label=records[i]["label"]))
    calls, errors, turns = (sum(o[k] for o in done) for k in ("tool_calls", "tool_errors", "turns"))
    return rollouts, {"multiturn/failed": float(len(outcomes) - len(done)),
                      "multiturn/tool_calls_mean": calls / max(1, len(done)),
                      "multiturn/tool_call_success": (calls - errors) / max(1, calls),
                      "multiturn/turns_mean": turns / max(1, len(done))}


def train(experience, policy, optimizer, options: Options, step: int) -> dict[str, float]:
    """PPO-clip + k3 KL over minibatches; each minibatch's gradient is accumulated over micro-batches of at most
    MICRO_BATCH_TOKENS tokens (losses normalised by the whole minibatch's counts), then one AdamW step."""
    stats: dict[str, float] = {}
    minibatches = list(iterate_minibatches(experience, num_minibatches=min(MINIBATCHES, experience.num_seqs),
                                           seed=step))
    for mb in minibatches:
        num_tokens, num_seqs = global_counts(mb.batch.loss_mask, mb.batch.cu_seqlens)
        micro_batches = partition_by_token_budget(mb.batch.cu_seqlens.diff(), max_tokens=MICRO_BATCH_TOKENS)
        optimizer.zero_grad(set_to_none=True)
        for indices in micro_batches:
            micro = select_experience(mb, indices).to(options.device)
            batch, mask, cu = micro.batch, micro.batch.loss_mask, micro.batch.cu_seqlens  # mask: sampled tokens
            logprobs = model_logprobs(policy, batch, temperature=options.temperature, loss_tokens_only=True)
            loss, pstats = policy_loss(logprobs, micro.old_logprobs, micro.advantages, mask, cu, clip_low=CLIP,
                                       clip_high=CLIP, num_tokens=num_tokens, num_seqs=num_seqs)
            kl, kstats = kl_loss(logprobs, micro.ref_logprobs, mask, cu, estimator="k3", num_tokens=num_tokens,
                                 num_seqs=num_seqs)
            (loss + options.kl_coef * kl).backward()
            pstats |= {"loss": float(loss.detach()), "kl_loss": kstats["kl_mean"]}
            for key, value in pstats.items():
                stats[key] = stats.get(key, 0.0) + value / len(minibatches) / len(micro_batches)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
        stats["grad_norm"] = stats.get("grad_norm", 0.0) + grad_norm / len(minibatches)
        optimizer.step()
    return stats


def main(argv=None) -> list[dict]:
    options = parse_options(Options, argv, description=__doc__)
    if options.device == "cpu":
        options = Options(**{**vars(options), "engine": "hf"})
    if options.tiny:
        options = Options(**{**vars(options), "steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
                             "max_new_tokens": 8, "max_turns": 2, "max_value": 99,
                             "lr": 1e-3})
    torch.manual_seed(SEED)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, policy, reference, engine = load(options)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=options.lr, weight_decay=0.0)
    task = ArithmeticTask(min_value=0, max_value=options.max_value, ops=("*", "+"), seed=SEED)
    chat = PromptDatasetConfig(apply_chat_template=True)  # prompts are whole chats: conversation(question)
    tools = ToolEnvironmentConfig(observation_template=observation_template(tokenizer), on_malformed="observe")
    multiturn = MultiTurnConfig(max_turns=options.max_turns, max_total_tokens=options.max_total_tokens,
                                step_timeout_s=10.0, max_attempts=2, group_policy="drop")
    endpoint = None
    if options.rollouts == "endpoint":  # concurrent requests are batched into engine calls
        endpoint = OpenAIEndpoint(engine, tokenizer, OpenAIEndpointConfig(
            model_name="policy", max_model_len=options.max_total_tokens,
            max_n=1, request_timeout_s=300.0)).start()
    config = ExperienceConfig(estimator="grpo")
    rows = []
    with (out / "metrics.jsonl").open("w") as metrics:
        for step in range(options.steps):
            count = options.prompts_per_step  # problems step * count ... of the task
            records = task.records(count, start=step * count)
            started = time.perf_counter()
            # 1. Conversations: sample a turn, run its tool calls, append the results' token ids, sample again.
            if endpoint is None:
                prompts = prompt_batch([{**r, "prompt": conversation(r["prompt"])} for r in records], tokenizer,
                                       chat)
                sampling = SamplingConfig(n=options.samples_per_prompt, max_new_tokens=options.max_new_tokens,
                                          temperature=options.temperature, seed=SEED * 1_000_003 + step)
                trajectories = generate_trajectories(
                    engine, prompts.token_ids, sampling, tokenizer=tokenizer, config=multiturn,
                    make_environment=lambda: ToolEnvironment(TOOLS, tools),
                    prompt_texts=prompts.texts, labels=prompts.labels)
                stats = trajectory_stats(trajectories)
                rollouts = trainable_rollouts(trajectories)  # whole groups only: a failed member drops its group
            else:
                rollouts, stats = endpoint_rollouts(endpoint, records, options, step)
            seconds = time.perf_counter() - started
            sampled = sum(int(r.response_loss_mask.sum()) if r.response_loss_mask is not None
                          else len(r.response_token_ids) for r in rollouts)
            stats |= {"rollout/seconds": seconds, "rollout/sampled_tokens_per_s": sampled / seconds}
            if not rollouts:
                print(f"step {step}: every group failed ({stats})", flush=True)
                continue
            # 2. Reward: the final answer (last turn's text) against the label.
            texts, answers, labels = rollout_texts(rollouts)
            scores, _ = apply_reward_function(arithmetic_reward, texts, answers, labels)
            # 3. GRPO advantages; log-probs of the trainer on exactly the sampled tokens (observations masked out).
            with torch.no_grad():
                experience, exp_stats = make_experience(
                    rollouts, torch.tensor(scores), config=config,
                    policy_logprobs_fn=lambda b: model_logprobs(policy, b.to(options.device), loss_tokens_only=True,
                                                                temperature=options.temperature),
                    ref_logprobs_fn=lambda b: model_logprobs(reference, b.to(options.device), loss_tokens_only=True,
                                                             temperature=options.temperature))
            experience_engine = engine_token_logprobs(rollouts, experience.batch)
            mask = experience.batch.loss_mask
            gap = float((experience_engine.to(mask.device) - experience.old_logprobs)[mask].abs().mean())
            # 4. Train, then 5. the engine takes the new weights.
            stats |= exp_stats | train(experience, policy, optimizer, options, step)
            engine.load_weights(policy.named_parameters())
            stats |= {"step": step, "accuracy": arithmetic_accuracy(answers, labels),
                      "engine_vs_trainer/mean_abs_logprob_diff": gap}
            rows.append({k: v for k, v in stats.items() if isinstance(v, (int, float))})
            metrics.write(json.dumps(rows[-1]) + "\n")
            metrics.flush()
            print(f"step {step}: reward {stats['reward/mean']:.3f} exact {stats['accuracy']:.2f} "
                  f"tool calls {stats['multiturn/tool_calls_mean']:.2f} (ok {stats['multiturn/tool_call_success']:.2f})"
                  f" turns {stats['multiturn/turns_mean']:.2f} failed {stats['multiturn/failed']:.0f} "
                  f"gap {gap:.2e} rollout {seconds:.2f} s", flush=True)
    if endpoint is not None:
        endpoint.close()
    return rows


if __name__ == "__main__":
    main()
