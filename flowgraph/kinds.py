"""Built-in node kinds, as plain data.

Contracts use the canonical global dims (Bp prompts, N samples per prompt, P prompt
length, T response length, V vocabulary) and one node-local dim, `b`: the batch a
node is given. `b` is bound from the node's first wired input and every other input
must agree, so a `(Bp,)` tensor meeting a `(Bp*N,)` one is caught with the chain of
bindings that led there. `generate` multiplies its batch by its own `n` (the param,
or the global N).

Notation: b batch of the node, B = Bp*N, P prompt length, T response length.

One module past ~450 lines, on purpose: the catalogue of every built-in kind, as data
(about 20 declarative lines a kind, no logic), read top to bottom like the reference it
generates.
"""

from __future__ import annotations

from dataclasses import replace

from flowgraph.choices import (
    DPO_LOSS_TYPES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    ROUTE_ALIAS,
    ROUTE_COLUMN,
    SHOW_TOOLS,
)
from flowgraph.contracts import MASK_DTYPE, TensorSpec
from flowgraph.kindspec import KindSpec, LossSpec, ParamSpec, PortSpec
from flowgraph.runtime.reward_call import FILTER_CALL, TRL_CALL, VERL_CALL


def _p(name: str, dims: str, dtype: str = "float", *constraints: str, optional: bool = False,
       doc: str = "") -> PortSpec:
    return PortSpec(name, TensorSpec(dims, dtype, tuple(constraints)), optional, doc)


def _f(name: str, default: float | None, doc: str = "", minimum: float | None = None) -> ParamSpec:
    types = ("float",) if default is not None else ("float", "null")
    return ParamSpec(name, types, default, doc=doc, minimum=minimum)


def _i(name: str, default: int | None, doc: str = "", dim: str | None = None,
       minimum: float | None = 1) -> ParamSpec:
    types = ("int",) if default is not None else ("int", "null")
    return ParamSpec(name, types, default, doc=doc, dim=dim, minimum=minimum)


def _b(name: str, default: bool, doc: str = "") -> ParamSpec:
    return ParamSpec(name, ("bool",), default, doc=doc)


def _s(name: str, default: str | None, choices: tuple[str, ...] = (), doc: str = "") -> ParamSpec:
    types = ("str",) if default is not None else ("str", "null")
    return ParamSpec(name, types, default, choices=choices, doc=doc)


# Port groups shared by many kinds: a tokenised prompt and its sampled response.
SEQUENCE_INPUTS = (
    _p("prompts", "b P", "int"),
    _p("prompt_mask", "b P", "mask", "binary"),
    _p("responses", "b T", "int"),
    _p("response_mask", "b T", "mask", "binary"),
)
ADV_OUTPUTS = (
    _p("advantages", "b T", "float", "finite"),
    _p("returns", "b T", "float", "finite"),
)
MASK = _p("response_mask", "b T", "mask", "binary")
SCORE_FUNCTIONS = ("gsm8k", "math")
SCORE_CALLS = (TRL_CALL, VERL_CALL)
"""How `compute_score` calls a function, by its signature: TRL's batch call, verl's per row."""
"""Built-in verl-style scoring functions (`flowgraph.nodes.scores`)."""
SCORES = _p("scores", "b", "float", "finite")
INDEX = _p("index", "b", "int", doc="group id: samples of one prompt share it")
EPISODE = _p("episode", "b", "int", optional=True,
             doc="an agent_rollout's `episode` (rows_per_episode > 1): a group's samples "
                 "are its episodes, each counted once (its rows share its score and get "
                 "its advantage); rows of episode -1 are unused: advantage 0")
TOKEN_REWARDS = _p("token_level_rewards", "b T", "float", "finite")
MAX_TOKEN_LEN = _i(
    "max_token_len", None, "token budget per forward/backward on one rank instead of "
    "micro_batch_size: consecutive rows while rows x longest (prompt + response) fits "
    "(verl's use_dynamic_bsz, ppo_max_token_len_per_gpu); at least P + T")
PACKING = _b(
    "packing", False, "run each forward as one row of the valid tokens, position ids "
    "restarting per sequence (verl's use_remove_padding): no pad token is computed; a "
    "budget then counts valid tokens. Pass `packing` sets it where the model's attention "
    "is varlen (flash_attention_2); elsewhere it builds an N x N mask")
BATCHING = (MAX_TOKEN_LEN, PACKING)
"""How a model node cuts its forwards: a token budget, and packing without padding."""
MINI_BATCH = (
    _i("ppo_epochs", 1, "passes over the batch per step"),
    _i("mini_batch_size", None, "sequences per optimizer step, over all data-parallel "
       "ranks (verl's ppo_mini_batch_size); null: the whole batch"),
    _i("micro_batch_size", None, "sequences per forward/backward on one rank (gradient "
       "accumulation); null: the rank's share of the mini-batch"),
    *BATCHING,
    _i("start_step", 0, "the first training step this update trains at; before it the "
       "update is skipped (its model, optimizer and LR schedule stay as they are): value "
       "warm-up (VAPO, VC-PPO) is the actor's update starting at k while the critic's "
       "trains from step 0", minimum=0),
)
"""The update loop's params, which every update kind declares (`flowgraph.runtime.update.
MiniBatching`; the loop reads them, the kind's implementation only `packing`)."""
LOSS_AGG_MODE = _s("loss_agg_mode", "token-mean", LOSS_AGG_MODES)
TRL_TEMPLATE = ParamSpec(
    "apply_chat_template", ("bool", "null"), None,
    doc="null (TRL's formats): a prompt that is a list of chat messages goes through the "
        "chat template with the generation prompt, a string prompt is raw text; true: a "
        "string prompt too (as one user message); false: no template (message lists are "
        "refused)")
"""The prompt and preference kinds: TRL's standard and conversational formats."""
VERL_SFT_TEMPLATE = _b("apply_chat_template", True,
                       "false: string prompts are raw text (a base model); true (verl's SFT "
                       "datasets): a string prompt is one user message in the chat template")
ROW_DOC = ("each row's dataset columns as a dict, its prompt (as the file holds it: a "
           "string or a message list) under `prompt`: what a TRL reward function reads")
DATA_PARAMS = (
    _s("truncation", "error", ("error", "left", "right"),
       "a row over its length limit: stop (error), keep a prompt's last (left) or first "
       "(right) tokens; responses keep their first"),
    _b("filter_overlong_prompts", False, "drop rows over a length limit when the data loads"),
)

_KINDS = (
    # --- data sources ------------------------------------------------------------
    KindSpec(
        "prompts", "data", "Prompt dataset (verl parquet layout, or JSONL).",
        outputs=(
            _p("input_ids", "Bp P", "int"),
            _p("attention_mask", "Bp P", MASK_DTYPE, "binary"),
            _p("ground_truth", "Bp", "object", optional=True),
            _p("data_source", "Bp", "object", optional=True),
            _p("extra_info", "Bp", "object", optional=True,
               doc="each row's `extra_info` dict (verl layout; {} without the column), with "
                   "the columns the param `columns` names"),
            _p("row", "Bp", "object", optional=True, doc=ROW_DOC),
            _p("uid", "Bp", "int", doc="row id in the dataset"),
        ),
        params=(
            _s("format", "auto", ("auto", "parquet", "jsonl", "builtin")),
            _s("prompt_key", "prompt"),
            ParamSpec("columns", ("list",), (), doc="more dataset columns for the rewards, "
                      "added to each row's extra_info by name (a struct field as "
                      "`reward_model.style`)"),
            _i("max_prompt_length", None, "left-pad prompts to this", dim="P"),
            _b("shuffle", True),
            _s("eval_path", None, doc="held-out prompts for evaluation"),
            TRL_TEMPLATE,
            *DATA_PARAMS,
        ),
        impl="flowgraph.nodes.data:prompt_source",
    ),
    KindSpec(
        "preferences", "data",
        "Preference pairs (TRL layout: prompt, chosen, rejected; or only chosen and rejected, "
        "the prompt their shared first messages).",
        outputs=(
            _p("prompts", "Bp P", "int"),
            _p("prompt_mask", "Bp P", MASK_DTYPE, "binary"),
            _p("chosen", "Bp T", "int"),
            _p("chosen_mask", "Bp T", MASK_DTYPE, "binary"),
            _p("rejected", "Bp T", "int"),
            _p("rejected_mask", "Bp T", MASK_DTYPE, "binary"),
            _p("uid", "Bp", "int", doc="row id in the dataset"),
        ),
        params=(
            _s("format", "auto", ("auto", "parquet", "jsonl", "builtin")),
            _i("max_prompt_length", None, dim="P"),
            _i("max_response_length", None, dim="T"),
            _b("shuffle", True),
            _s("eval_path", None),
            TRL_TEMPLATE,
            *DATA_PARAMS,
        ),
        impl="flowgraph.nodes.data:preference_source",
    ),
    KindSpec(
        "sft", "data",
        "Prompt-response rows for supervised fine-tuning (verl SFT parquet: prompt and "
        "response columns, or a chat `messages` list).",
        outputs=(
            _p("prompts", "Bp P", "int"),
            _p("prompt_mask", "Bp P", MASK_DTYPE, "binary"),
            _p("responses", "Bp T", "int"),
            _p("response_mask", "Bp T", MASK_DTYPE, "binary"),
            _p("loss_mask", "Bp T", MASK_DTYPE, "binary", optional=True,
               doc="the response tokens trained on: all of a one-answer row, the assistant "
                   "turns of a multi-turn conversation"),
            _p("uid", "Bp", "int", doc="row id in the dataset"),
        ),
        params=(
            _s("format", "auto", ("auto", "parquet", "jsonl", "builtin")),
            _s("prompt_key", "prompt", doc="the prompt column (string or message list); a "
               "struct field by its dotted name, as verl's prompt_dict_keys"),
            _s("response_key", "response", doc="the response column (a string)"),
            _s("messages_key", "messages", doc="a chat column read when the prompt column is "
               "absent: the messages before the first assistant turn are the prompt, the rest "
               "the response, its assistant turns trained (loss_mask)"),
            _i("max_prompt_length", None, dim="P"),
            _i("max_response_length", None, dim="T"),
            _b("shuffle", True),
            _s("eval_path", None),
            VERL_SFT_TEMPLATE,
            *DATA_PARAMS,
        ),
        impl="flowgraph.nodes.data:sft_source",
    ),
    # --- rollout and model passes ------------------------------------------------
    KindSpec(
        "generate", "rollout",
        "Sample n responses per prompt with Hugging Face generate or vLLM.",
        inputs=(
            _p("prompts", "b P", "int"),
            _p("prompt_mask", "b P", "mask", "binary"),
            _p("ground_truth", "b", "object", optional=True),
            _p("data_source", "b", "object", optional=True),
            _p("extra_info", "b", "object", optional=True),
            _p("row", "b", "object", optional=True, doc=ROW_DOC),
        ),
        outputs=(
            _p("prompts", "b*n P", "int"),
            _p("prompt_mask", "b*n P", MASK_DTYPE, "binary"),
            _p("responses", "b*n T", "int"),
            _p("response_mask", "b*n T", MASK_DTYPE, "binary"),
            _p("rollout_log_prob", "b*n T", "float", "nonpositive", optional=True),
            _p("index", "b*n", "int", doc="group id: the prompt's position in the batch"),
            _p("ground_truth", "b*n", "object", optional=True),
            _p("data_source", "b*n", "object", optional=True),
            _p("extra_info", "b*n", "object", optional=True),
            _p("row", "b*n", "object", optional=True, doc=ROW_DOC),
        ),
        params=(
            _s("backend", "hf", ("hf", "vllm")),
            _i("n", None, "samples per prompt; null: the global N", dim="n"),
            _f("temperature", 1.0, minimum=0.0),
            _f("top_p", 1.0, minimum=0.0),
            _i("top_k", 0, "0: off", minimum=0),
            _i("max_new_tokens", None, "response length; binds T", dim="T"),
            _b("do_sample", True),
            replace(_i("val_n", 1, "held-out responses per prompt at evaluation (val/accuracy "
                       "is their mean, mean@n; val/pass@n: a prompt with any right); > 1 "
                       "needs val_temperature > 0"), evaluation=True),
            replace(_f("val_temperature", 0.0, "sampling temperature at evaluation (verl's "
                       "val_kwargs); 0: greedy, one response per prompt", minimum=0.0),
                    evaluation=True),
            _f("gpu_memory_utilization", None, "vLLM only: the share of accelerator memory "
               "(on CPU: of NUMA node 0's RAM) the engine takes; null: a KV cache sized for "
               "the node's sequences of P+T tokens", minimum=0.0),
        ),
        model="required",
        impl="flowgraph.nodes.generate:generate",
        dim_defaults=(("n", "N"),),
    ),
    KindSpec(
        "agent_rollout", "rollout",
        "Multi-turn episodes: the policy answers, calls tools (Hermes-style tool calls) and "
        "reads their output or the environment's reply, for up to max_turns turns; token "
        "in, token out (the sampled ids are kept, new messages are rendered as a delta).",
        inputs=(
            _p("row", "b", "object", doc="each row's dataset columns (the data's `row`): the "
                                         "task `Env.reset` builds the first prompt from"),
            _p("ground_truth", "b", "object", optional=True),
            _p("data_source", "b", "object", optional=True),
            _p("extra_info", "b", "object", optional=True),
        ),
        outputs=(
            _p("prompts", "b*n*c P", "int", doc="the first prompt (a fork's row: the "
                                                "fork's history, up to P), left-padded"),
            _p("prompt_mask", "b*n*c P", MASK_DTYPE, "binary"),
            _p("responses", "b*n*c T", "int", doc="every token after the first prompt: "
                                                  "the policy's turns and the messages "
                                                  "between"),
            _p("response_mask", "b*n*c T", MASK_DTYPE, "binary",
               doc="1 exactly on the tokens the policy sampled (tool and user tokens are "
                   "holes): what losses and advantages read"),
            _p("rollout_log_prob", "b*n*c T", "float", "nonpositive", optional=True),
            _p("policy_version", "b*n*c T", "int", optional=True,
               doc="the policy version (updates applied) of the weights that sampled each "
                   "token, -1 on the tokens it did not sample; with trainer.partial_rollouts "
                   "an episode's turns may come from several versions"),
            _p("index", "b*n*c", "int", doc="group id: the prompt's position in the batch"),
            _p("episode", "b*n*c", "int", optional=True,
               doc="each row's episode (-1 on an episode's unused rows): with "
                   "rows_per_episode > 1, what grpo and rloo count one sample by"),
            _p("scores", "b*n*c", "float", "finite", optional=True,
               doc="the episode's reward (`Env.reward`) plus its turns' rewards"),
            _p("token_level_rewards", "b*n*c T", "float", "finite", optional=True,
               doc="each turn's reward at its last sampled token, the episode's reward at "
                   "the last one (for gae, reinforce_pp: credit per turn)"),
            _p("turn_rewards", "b*n*c K", "float", "finite", optional=True,
               doc="one reward per assistant turn (`Step.reward`, tools' rewards)"),
            _p("turn_mask", "b*n*c K", MASK_DTYPE, "binary", optional=True,
               doc="1 on the turns the episode took"),
            _p("num_turns", "b*n*c", "int", optional=True),
            _p("tool_calls", "b*n*c", "int", optional=True),
            _p("status", "b*n*c", "object", optional=True,
               doc="completed, max_turns, context_exhausted, timeout or error"),
            _p("messages", "b*n*c", "object", optional=True,
               doc="each episode's conversation (chat messages), for reward functions"),
            _p("reward_extra_info", "b*n*c", "object", optional=True,
               doc="each episode's status, turns and tool calls, and the entries of a dict "
                   "`Env.reward` returned: the validation table's columns"),
            _p("ground_truth", "b*n*c", "object", optional=True),
            _p("data_source", "b*n*c", "object", optional=True),
            _p("extra_info", "b*n*c", "object", optional=True),
            _p("row", "b*n*c", "object", optional=True, doc=ROW_DOC),
        ),
        params=(
            ParamSpec("env", ("str", "null"), None, functions=(), agent="env",
                      files=(".yaml", ".yml"),
                      doc="the environment: a `flowgraph.Env` subclass, a TRL "
                          "environment_factory class or a verl BaseTool, as `file.py:Name` "
                          "(the file listed under plugins:), `module:Name` or the class "
                          "itself, or a verl tool-config .yaml; null: a plain env over "
                          "`tools`"),
            ParamSpec("envs", ("mapping", "null"), None, functions=(), agent="env",
                      files=(".yaml", ".yml"),
                      doc="several environments by name, one dataset: each row's episodes "
                          "run in the env its `route_by` column names (SkyRL's env_class, "
                          "verl's agent_name); each value is what `env` takes; null: the "
                          "one `env`"),
            _s("route_by", ROUTE_COLUMN, (),
               "the dataset column naming each row's env of `envs` (a row without it: "
               f"its `{ROUTE_ALIAS}` column, verl's name, when route_by is left "
               f"`{ROUTE_COLUMN}`)"),
            ParamSpec("agent", ("str", "null"), None, functions=(), agent="program",
                      doc="a black-box agent program instead of an env: `async def "
                          "run(task, client) -> float | dict`, as `file.py:run`, "
                          "`module:run` or the function; `client` is an openai.AsyncOpenAI "
                          "on the rollout's endpoint (flowgraph.agent.sessions)"),
            ParamSpec("env_params", ("mapping", "null"), None,
                      doc="keyword arguments the env is made with, once per episode; "
                          "with `envs`, each env's own by its name ({calc: {...}}; an env "
                          "not named takes none)"),
            ParamSpec("tools", ("list",), (), functions=(), agent="tools",
                      doc="tools every episode may call besides the env's: functions "
                          "(typed, Google-style docstring) or `flowgraph.tool`s, as "
                          "`file.py:name`, `module:name` or the objects"),
            ParamSpec("mcp_servers", ("mapping", "null"), None, agent="mcp",
                      doc="tools from MCP servers besides `tools` and the env's: server "
                          "name -> {command: [program, args...], env: {VAR: value}, cwd "
                          "(default: the graph file's folder), start_timeout_s (30), check "
                          "(true: `flowgraph check` starts it, FG610)}; stdio servers, one "
                          "per process, their tools from list_tools "
                          "(flowgraph.agent.mcp_servers)"),
            _s("parser", "hermes", (), "how tool calls are read from a turn: a name of "
                                      "flowgraph.agent.PARSERS (hermes: <tool_call>{json}"
                                      "</tool_call>, Qwen / ChatML)"),
            _i("max_turns", 4, "assistant turns per episode at most; binds K", dim="K"),
            _i("max_new_tokens", None, "the whole response budget (every turn and every "
               "message between); binds T", dim="T"),
            _i("max_turn_tokens", None, "tokens one assistant turn may sample; null: what is "
               "left of T"),
            _i("max_tool_tokens", 256, "tokens one tool result (or env message) may take; "
               "longer ones are cut, the `...(N chars cut)` marker counted in them"),
            _s("truncate_side", "middle", ("left", "middle", "right"),
               "which part of a long tool result is cut: left keeps its end, right its "
               "start, middle both ends (verl's tool_response_truncate_side)"),
            _f("tool_timeout_s", 30.0, "seconds one tool call may take (a tool's own "
               "timeout_s wins)", minimum=0.0),
            _f("turn_timeout_s", 120.0, "seconds the tools and the env may take in one turn",
               minimum=0.0),
            _f("episode_timeout_s", 600.0, "seconds the env and tools may take in one "
               "episode", minimum=0.0),
            _s("on_error", "mask", ("mask", "zero", "raise"),
               "an episode that timed out or raised: mask (no token trained, score 0), "
               "zero (trained with score 0) or raise (stop the run, naming the row)"),
            _i("concurrency", 64, "episodes whose tools and env run at once (a sync call "
               "in a thread of its own)"),
            replace(_s("chat_template", None, (), "a Jinja chat template (text or a .jinja "
                       "file) instead of the tokenizer's"), files=(".jinja",)),
            _s("show_tools", "template", SHOW_TOOLS,
               "how the tools reach the prompt: template (the chat template renders "
               "`tools`; one that does not is refused), system (flowgraph lists their "
               "JSON schemas in a system message, hermes format) or none (no prompt lists "
               "them: a model trained on its tools, an env whose prompt describes them)"),
            _s("backend", "hf", ("hf", "vllm")),
            _i("n", None, "samples per prompt; null: the global N", dim="n"),
            _i("rows_per_episode", 1, "rows each episode takes (binds c: b·n·c rows): a "
               "black-box agent's fork (a history that does not extend the session's) "
               "closes its row and starts the next; past the last, the chain so far is "
               "not trained (agent/forks_dropped). Unused rows train nothing; wire "
               "`episode` into grpo / rloo", dim="c"),
            _f("temperature", 1.0, minimum=0.0),
            _f("top_p", 1.0, minimum=0.0),
            _i("top_k", 0, "0: off", minimum=0),
            _b("do_sample", True),
            replace(_i("val_n", 1, "held-out episodes per prompt at evaluation"),
                    evaluation=True),
            replace(_f("val_temperature", 0.0, "sampling temperature at evaluation; 0: "
                       "greedy", minimum=0.0), evaluation=True),
            _f("gpu_memory_utilization", None, "vLLM only, as generate's", minimum=0.0),
        ),
        model="required",
        impl="flowgraph.nodes.agent:agent_rollout",
        dim_defaults=(("n", "N"), ("c", "1")),
    ),
    KindSpec(
        "logprob", "model", "Per-token log-probs (and entropy) of responses, in chunks.",
        inputs=SEQUENCE_INPUTS,
        outputs=(
            _p("log_prob", "b T", "float", "nonpositive", "finite"),
            _p("entropy", "b T", "float", "nonnegative", optional=True),
        ),
        params=(
            _i("chunk_size", 1024, "tokens per chunk of the vocabulary projection"),
            _f("temperature", 1.0, minimum=0.0),
            _i("micro_batch_size", None),
            *BATCHING,
        ),
        model="required",
        impl="flowgraph.nodes.logprob:logprob",
    ),
    KindSpec(
        "sequence_logprob", "model", "Summed response log-prob per sequence (DPO).",
        inputs=SEQUENCE_INPUTS,
        outputs=(_p("log_prob", "b", "float", "nonpositive", "finite"),),
        params=(_i("chunk_size", 1024), _i("micro_batch_size", None), *BATCHING),
        model="required",
        impl="flowgraph.nodes.logprob:sequence_logprob",
    ),
    KindSpec(
        "values", "model", "Critic: causal-LM backbone + scalar value head, one value per token.",
        inputs=SEQUENCE_INPUTS,
        outputs=(_p("values", "b T", "float", "finite"),),
        params=(_i("micro_batch_size", None), *BATCHING),
        model="required",
        head="scalar",
        impl="flowgraph.nodes.values:values",
    ),
    # --- rewards -------------------------------------------------------------------
    KindSpec(
        "reward", "reward",
        "Rule-based outcome reward; the model binding (optional) lends its tokenizer.",
        inputs=(
            _p("responses", "b T", "int"),
            _p("response_mask", "b T", "mask", "binary"),
            _p("ground_truth", "b", "object", optional=True),
        ),
        outputs=(SCORES,),
        params=(
            _s("fn", "exact_match", ("exact_match", "format", "length_penalty")),
            _f("correct_score", 1.0),
            _f("format_score", 0.0),
            _i("target_length", None),
            _f("length_coef", 0.01),
        ),
        model="optional",
        head="tokenizer",
        impl="flowgraph.nodes.reward:rule_reward",
        required_when=(("ground_truth", "fn", "exact_match"),),
    ),
    KindSpec(
        "compute_score", "reward",
        "Reward functions as their authors wrote them, chosen by signature: TRL's "
        "f(prompts, completions, completion_ids, **columns) -> list[float | None] once "
        "per batch, verl's compute_score(data_source, solution_str, ground_truth, "
        "extra_info) -> float or dict with `score` once per row.",
        inputs=(
            _p("responses", "b T", "int"),
            _p("response_mask", "b T", "mask", "binary"),
            _p("ground_truth", "b", "object", optional=True),
            _p("data_source", "b", "object", optional=True),
            _p("extra_info", "b", "object", optional=True),
            _p("messages", "b", "object", optional=True,
               doc="each episode's messages (an agent_rollout's `messages`): a TRL "
                   "function's `completions` are then each episode's turns and the tools' "
                   "messages between them, as TRL passes a tool-using episode"),
            _p("row", "b", "object", optional=True,
               doc="each row's dataset columns (the data's `row`, through generate): a TRL "
                   "function's `prompts` and keyword arguments; needed by one"),
        ),
        outputs=(SCORES, _p("reward_extra_info", "b", "object", optional=True,
                            doc="each row's other entries of a dict result (verl's "
                                "reward_extra_info) and a TRL function's log_extra "
                                "columns: the validation table's columns"),
                 _p("score_mask", "b", MASK_DTYPE, "binary", optional=True,
                    doc="0 where every function returned None (TRL: the row is "
                        "unscorable; its score is 0): wire it into grpo's score_mask to "
                        "leave the row out of its group's baseline, as TRL does")),
        params=(
            ParamSpec("fn", ("str", "list", "null"), None, functions=SCORE_FUNCTIONS,
                      calls=SCORE_CALLS,
                      doc="the reward function: `file.py:function` (the file listed under "
                          "plugins:), `module:function` (listed too), a built-in (gsm8k, "
                          "math) or a Python callable; a list of them is TRL's reward_funcs, "
                          "their values summed with `weights` (None skipped, as nansum)"),
            ParamSpec("weights", ("list", "null"), None, one_per="fn",
                      doc="one weight per function of a list `fn` (TRL's reward_weights); "
                          "null: each weighs 1"),
            ParamSpec("fns", ("mapping", "null"), None, functions=SCORE_FUNCTIONS,
                      calls=SCORE_CALLS,
                      doc="data_source -> function (TRL's or verl's), as verl's default "
                          "reward routes; rows of other sources go to fn"),
        ),
        model="optional",
        head="tokenizer",
        impl="flowgraph.nodes.reward:compute_score",
    ),
    KindSpec(
        "judge", "reward",
        "A model as judge: each prompt and response (decoded with the policy's tokenizer) "
        "rendered into a rubric template and scored by a frozen model of the graph, "
        "decoding greedily, or by an OpenAI-compatible server; the score is the number of "
        "the reply's last `Score: <n>` (score_pattern), and a reply without one in "
        "[min_score, max_score] scores invalid_score. Metrics judge/invalid, judge/mean.",
        inputs=(*SEQUENCE_INPUTS, _p("ground_truth", "b", "object", optional=True,
                                     doc="the template's `{ground_truth}`, when it names it")),
        outputs=(SCORES,),
        params=(
            ParamSpec("template", ("str",), None, required=True,
                      fields=(("prompt", "prompts"), ("response", "responses"),
                              ("ground_truth", "ground_truth")),
                      doc="the rubric, a Python format string over the fields {prompt}, "
                          "{response} and {ground_truth} (wired); given to the judge as one "
                          "user message (through its chat template when it has one)"),
            replace(_s("policy", "actor", doc="the model whose tokenizer decodes the prompts "
                                              "and responses (the one that sampled them)"),
                    names_model=True),
            _i("max_new_tokens", 32, "tokens of the judge's reply (greedy)"),
            _s("score_pattern", r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)",
               doc="regular expression whose last match's first group is the score"),
            _f("min_score", 0.0, "the lowest valid score"),
            _f("max_score", 10.0, "the highest valid score"),
            _f("invalid_score", 0.0, "the score of a reply without a valid one (counted in "
                                     "judge/invalid)"),
            replace(_s("url", None, doc="an OpenAI-compatible server's base URL (`.../v1`) "
                                        "as the judge instead of a model of the graph"),
                    instead_of_model=True),
            _s("api_model", None, doc="the `model` a request to `url` names"),
            _s("api_key_env", None, doc="the environment variable holding the server's API "
                                        "key (sent as a bearer token); null: none"),
            _i("concurrency", 8, "requests to `url` in flight at once"),
            _i("retries", 3, "tries after a failed or timed-out request, waiting "
                             "backoff_s * 2^k before the k-th", minimum=0),
            _f("backoff_s", 1.0, "the first wait before a retry (seconds)", minimum=0),
            _f("request_timeout_s", 60.0, "one request's time limit (seconds)", minimum=0),
            _b("cache", True, "keep each reply of `url` under the run dir "
                              "(judge_cache/<node>/), keyed by a hash of the request: a resumed "
                              "or repeated run asks once"),
        ),
        model="optional",
        head="lm",
        impl="flowgraph.nodes.judge:judge",
    ),
    KindSpec(
        "reward_model", "reward", "Sequence classifier scored at the last valid token.",
        inputs=SEQUENCE_INPUTS,
        outputs=(SCORES,),
        params=(_i("micro_batch_size", None), *BATCHING),
        model="required",
        head="scalar",
        impl="flowgraph.nodes.reward:reward_model",
    ),
    KindSpec(
        "token_reward", "transform", "Place an outcome score on the last valid response token.",
        inputs=(SCORES, MASK),
        outputs=(_p("token_level_scores", "b T", "float", "finite"),),
        impl="flowgraph.nodes.reward:token_reward",
    ),
    KindSpec(
        "kl_penalty", "transform",
        "Subtract kl_coef * KL(actor || ref) per token from the token scores.",
        inputs=(
            _p("token_level_scores", "b T", "float", "finite"),
            _p("log_prob", "b T", "float", "nonpositive"),
            _p("ref_log_prob", "b T", "float", "nonpositive"),
            MASK,
        ),
        outputs=(TOKEN_REWARDS, _p("kl", "b T", "float", "finite", optional=True)),
        params=(
            _f("kl_coef", 0.001, minimum=0.0),
            _s("penalty", "kl", KL_ESTIMATORS),
            _f("target_kl", None, "adaptive controller target (Ziegler et al. 2019)"),
            _i("horizon", 10000),
        ),
        impl="flowgraph.nodes.kl:kl_penalty",
    ),
    # --- advantage estimators -------------------------------------------------------
    KindSpec(
        "gae", "advantage", "Generalised advantage estimation (Schulman et al. 2016).",
        inputs=(TOKEN_REWARDS, _p("values", "b T", "float", "finite"), MASK),
        outputs=ADV_OUTPUTS,
        params=(_f("gamma", 1.0, minimum=0.0), _f("lam", 1.0, minimum=0.0), _b("whiten", True)),
        impl="flowgraph.nodes.advantage:gae",
    ),
    KindSpec(
        "grpo", "advantage", "Group-normalised outcome advantage (Shao et al. 2024).",
        inputs=(SCORES, MASK, INDEX,
                _p("score_mask", "b", MASK_DTYPE, "binary", optional=True,
                   doc="0 for a row no reward function scored (compute_score's "
                       "score_mask): left out of its group's mean and std, advantage 0 "
                       "(TRL)"), EPISODE),
        outputs=ADV_OUTPUTS,
        params=(_f("epsilon", 1e-6, "added to the group's std before dividing (verl 1e-6; "
                   "TRL 1e-4)", minimum=0.0), _b("norm_by_std", True)),
        grouped=True,
        impl="flowgraph.nodes.advantage:grpo",
    ),
    KindSpec(
        "rloo", "advantage", "Leave-one-out baseline (Ahmadian et al. 2024).",
        inputs=(SCORES, MASK, INDEX, EPISODE),
        outputs=ADV_OUTPUTS,
        grouped=True,
        impl="flowgraph.nodes.advantage:rloo",
    ),
    KindSpec(
        "reinforce_pp", "advantage", "REINFORCE++: discounted return, whitened (Hu 2025).",
        inputs=(TOKEN_REWARDS, MASK),
        outputs=ADV_OUTPUTS,
        params=(_f("gamma", 1.0, minimum=0.0),),
        impl="flowgraph.nodes.advantage:reinforce_pp",
    ),
    KindSpec(
        "reinforce_pp_baseline", "advantage", "REINFORCE++ with a group-mean baseline.",
        inputs=(SCORES, MASK, INDEX),
        outputs=ADV_OUTPUTS,
        params=(_f("epsilon", 1e-6, minimum=0.0),),
        grouped=True,
        impl="flowgraph.nodes.advantage:reinforce_pp_baseline",
    ),
    KindSpec(
        "remax", "advantage", "ReMax: return minus the greedy rollout's reward (Li et al. 2023).",
        inputs=(TOKEN_REWARDS, _p("reward_baselines", "b", "float", "finite"), MASK),
        outputs=ADV_OUTPUTS,
        impl="flowgraph.nodes.advantage:remax",
    ),
    # --- reward shaping and per-prompt values ---------------------------------------
    KindSpec(
        "overlong_penalty", "transform",
        "DAPO's soft overlong punishment added to the scores (Yu et al. 2025).",
        inputs=(SCORES, MASK),
        outputs=(SCORES, _p("penalty", "b", "float", "finite", optional=True,
                            doc="the term added: 0 down to -penalty_factor")),
        params=(
            ParamSpec("overlong_buffer_len", ("int",), None, required=True, minimum=1,
                      doc="L_cache: the last tokens of the budget, over which the penalty "
                          "ramps from 0 to -penalty_factor"),
            _i("max_response_length", None, "L_max; null: T"),
            _f("penalty_factor", 1.0, minimum=0.0),
        ),
        impl="flowgraph.nodes.shaping:overlong_penalty",
    ),
    KindSpec(
        "length_penalty", "transform",
        "-coef * |length - target| (no target: -coef * length) added to the scores.",
        inputs=(SCORES, MASK),
        outputs=(SCORES, _p("penalty", "b", "float", "finite", optional=True)),
        params=(_f("coef", 0.01, minimum=0.0),
                _i("target_length", None, "in tokens; null: penalise every token")),
        impl="flowgraph.nodes.shaping:length_penalty",
    ),
    KindSpec(
        "weighted_sum", "transform",
        "Sum of the reward terms you wire (any input names), each times its weight; "
        "each term's mean is logged as reward/<term>/mean.",
        outputs=(SCORES,),
        params=(ParamSpec("weights", ("mapping", "null"), None,
                          doc="term name -> weight; a term not named weighs 1"),),
        impl="flowgraph.nodes.shaping:weighted_sum",
        terms=_p("term", "b", "float", "finite", doc="one number per sequence"),
    ),
    KindSpec(
        "repeat", "transform",
        "Each row's value n times in a row: per-prompt values (ReMax's greedy baseline, "
        "a ground truth) broadcast to the prompt's n samples, as generate orders them.",
        inputs=(_p("x", "b", "any"),),
        outputs=(_p("x", "b*n", "any"),),
        params=(_i("n", None, "copies of each row; null: the global N (at evaluation: the "
                   "rollouts' held-out n, once per prompt when greedy)", dim="n"),),
        impl="flowgraph.nodes.shaping:repeat",
        dim_defaults=(("n", "N"),),
    ),
    # --- losses and updates ---------------------------------------------------------
    KindSpec(
        "dpo_loss", "transform", "Per-pair DPO loss and implicit rewards (Rafailov et al. 2023).",
        inputs=(
            _p("policy_chosen_logps", "b", "float", "nonpositive"),
            _p("policy_rejected_logps", "b", "float", "nonpositive"),
            _p("ref_chosen_logps", "b", "float", "nonpositive"),
            _p("ref_rejected_logps", "b", "float", "nonpositive"),
        ),
        outputs=(
            _p("losses", "b", "float", "finite"),
            _p("chosen_rewards", "b", "float", "finite"),
            _p("rejected_rewards", "b", "float", "finite"),
        ),
        params=(
            _f("beta", 0.1, minimum=0.0),
            _s("loss_type", "sigmoid", DPO_LOSS_TYPES),
            _f("label_smoothing", 0.0, minimum=0.0),
        ),
        impl="flowgraph.nodes.losses:dpo_loss",
    ),
    KindSpec(
        "ppo_actor_update", "update", "PPO clipped policy-gradient update of the actor.",
        inputs=(
            *SEQUENCE_INPUTS,
            _p("old_log_prob", "b T", "float", "nonpositive", optional=True,
               doc="log π_old; may stay unwired when ppo_epochs is 1 and mini_batch_size "
                   "null or at least the batch (one optimizer step: π_old is the policy "
                   "the update starts from)"),
            _p("advantages", "b T", "float", "finite"),
            _p("ref_log_prob", "b T", "float", "nonpositive", optional=True,
               doc="wire it for a KL loss (GRPO) instead of a KL reward penalty"),
            _p("rollout_log_prob", "b T", "float", "nonpositive", optional=True,
               doc="generate's own log-probs, for rollout_is"),
        ),
        params=(
            ParamSpec("policy_loss", ("str",), "vanilla", names="policy_loss",
                      doc="vanilla, gspo, cispo, gpg, clip_cov, kl_cov (verl's names), or "
                          "one a plugin declares with @policy_loss"),
            ParamSpec("policy_loss_params", ("mapping", "null"), None, doc="the policy loss's own "
                      "params (clip_cov: clip_cov_ratio, clip_cov_lb, clip_cov_ub; kl_cov: "
                      "kl_cov_ratio, ppo_kl_coef)"),
            _f("clip_ratio_low", 0.2, minimum=0.0),
            _f("clip_ratio_high", 0.2, minimum=0.0),
            _f("clip_ratio_c", 3.0, minimum=1.0),
            replace(_s("rollout_is", None, ("token", "sequence"),
                       "rollout correction: weigh each token (or sequence) by pi_old / "
                       "pi_rollout from generate's rollout_log_prob; null: off"),
                    per_sequence=("sequence",)),
            _f("rollout_is_threshold", 2.0, "weights above are truncated to it (TIS)",
               minimum=0.0),
            _f("rollout_is_threshold_lower", None, "set: tokens with weights outside "
               "[lower, threshold] are masked out instead (IcePop)", minimum=0.0),
            _f("loss_scale_factor", None, "seq-mean-token-sum-norm divides by it; null: T"),
            _f("entropy_coeff", 0.0),
            _f("kl_loss_coef", 0.001, minimum=0.0),
            _s("kl_loss_type", "low_var_kl", KL_ESTIMATORS),
            _f("temperature", 1.0, "the rollout's sampling temperature: log-probs are "
               "recomputed at it, as old_logprob computes them", minimum=0.0),
            *MINI_BATCH,
            LOSS_AGG_MODE,
        ),
        model="required",
        trains=True,
        impl="flowgraph.nodes.update:ppo_actor_update",
        on_policy_input="old_log_prob",
        required_when=(("rollout_log_prob", "rollout_is", "token"),
                       ("rollout_log_prob", "rollout_is", "sequence")),
    ),
    KindSpec(
        "ppo_critic_update", "update", "Clipped value-loss update of the critic.",
        inputs=(
            *SEQUENCE_INPUTS,
            _p("values", "b T", "float", "finite"),
            _p("returns", "b T", "float", "finite"),
        ),
        params=(_f("cliprange_value", 0.5, minimum=0.0), *MINI_BATCH, LOSS_AGG_MODE),
        model="required",
        head="scalar",
        trains=True,
        impl="flowgraph.nodes.update:ppo_critic_update",
    ),
    KindSpec(
        "sft_update", "update",
        "Supervised fine-tuning: cross-entropy of the response tokens given the prompt "
        "(prompt tokens carry no loss; with loss_mask, only the tokens it marks).",
        inputs=(*SEQUENCE_INPUTS,
                _p("loss_mask", "b T", "mask", "binary", optional=True,
                   doc="the response tokens trained on, among response_mask's (default: "
                       "all of them)")),
        params=(*MINI_BATCH, LOSS_AGG_MODE),
        model="required",
        trains=True,
        impl="flowgraph.nodes.update:sft_update",
    ),
    KindSpec(
        "dpo_update", "update", "DPO update of the policy on preference pairs.",
        inputs=(
            _p("prompts", "b P", "int"),
            _p("prompt_mask", "b P", "mask", "binary"),
            _p("chosen", "b T", "int"),
            _p("chosen_mask", "b T", "mask", "binary"),
            _p("rejected", "b T", "int"),
            _p("rejected_mask", "b T", "mask", "binary"),
            _p("ref_chosen_logps", "b", "float", "nonpositive"),
            _p("ref_rejected_logps", "b", "float", "nonpositive"),
        ),
        params=(
            _f("beta", 0.1, minimum=0.0),
            _s("loss_type", "sigmoid", DPO_LOSS_TYPES),
            _f("label_smoothing", 0.0, minimum=0.0),
            *MINI_BATCH,
        ),
        model="required",
        sequences_per_row=2,
        trains=True,
        impl="flowgraph.nodes.update:dpo_update",
        not_taken=(("loss_agg_mode", "DPO's loss is one number per pair, from each "
                    "response's log-prob summed over its tokens (Rafailov et al. 2023), "
                    "averaged over the pairs: there are no per-token losses to aggregate"),),
    ),
)

# --- filter: data-dependent batch dims (DAPO's dynamic sampling, #13.4) ----------------
FILTERED = (
    _p("scores", "b", "float", "finite"),
    _p("index", "b", "int", doc="group id: the kept groups are renumbered 0..g-1"),
    _p("prompts", "b P", "int"),
    _p("prompt_mask", "b P", "mask", "binary"),
    _p("responses", "b T", "int"),
    _p("response_mask", "b T", "mask", "binary"),
    _p("rollout_log_prob", "b T", "float", "nonpositive", optional=True),
    _p("ground_truth", "b", "object", optional=True),
)
_FILTER_KINDS = (
    KindSpec(
        "filter", "filter",
        "Keep the sample groups a predicate accepts (DAPO dynamic sampling); the run draws "
        "the next data batches until `groups` groups are kept.",
        inputs=FILTERED,
        outputs=tuple(_p(p.name, p.spec.dims.replace("b", "g*n", 1),
                         MASK_DTYPE if p.spec.dtype == "mask" else p.spec.dtype,
                         *p.spec.constraints, optional=p.optional, doc=p.doc)
                      for p in FILTERED),  # gives masks as generate does: one mask type
        params=(
            _s("metric", "std_nonzero", ("std_nonzero", "mean_in_range"),
               "std_nonzero (DAPO): keep groups whose scores are not all equal (a group of "
               "one is kept); mean_in_range: min_score <= group mean <= max_score; not "
               "used when `fn` is set"),
            ParamSpec("fn", ("str", "null"), None, functions=(), calls=(FILTER_CALL,),
                      replaces="metric",
                      doc="your own predicate instead of `metric`: `def keep(scores: "
                          "list[float]) -> bool`, called once per sample group with that "
                          "group's scores (in row order) as one positional list; True keeps "
                          "the group. The Python function itself, `file.py:keep` (the file "
                          "listed under plugins:) or `module:keep`; null: `metric`"),
            _f("min_score", None, "mean_in_range: lowest group mean kept; null: no bound"),
            _f("max_score", None, "mean_in_range: highest group mean kept; null: no bound"),
            _i("groups", None, "groups in the filtered batch (verl's train_batch_size); "
               "null: Bp. Binds the output dim g", dim="g"),
            _i("max_tries", 10, "generation batches drawn per step at most (verl's "
               "max_num_gen_batches); fewer kept groups then stop the run"),
        ),
        grouped=True,
        impl="flowgraph.nodes.filter:filter_groups",
        dim_defaults=(("g", "Bp"), ("n", "N")),
    ),
)

_PARAM_DOCS = {
    "backend": "rollout engine: hf (the decoding loop here) or vllm",
    "beta": "DPO's inverse temperature: the scale of the implicit reward log(pi/pi_ref)",
    "chunk_size": "tokens per chunk of the vocabulary projection (peak memory chunk x V)",
    "clip_ratio_c": "dual-clip bound for negative advantages (verl's clip_ratio_c)",
    "clip_ratio_high": "upper clip range: ratio <= 1 + clip_ratio_high (DAPO's clip-higher)",
    "clip_ratio_low": "lower clip range: ratio >= 1 - clip_ratio_low",
    "cliprange_value": "value clipping around the old values (verl's cliprange_value)",
    "coef": "penalty per token of distance from the target length",
    "correct_score": "score of a correct answer",
    "do_sample": "false: greedy decoding",
    "entropy_coeff": "weight of the entropy bonus in the loss (0: reported, not trained)",
    "epsilon": "added to the group's std before dividing (numerical safety)",
    "eval_path": "held-out data for evaluation (same layout)",
    "fn": "scoring rule: exact_match of the answer, format (any number), length_penalty",
    "format": "file format; auto: from the extension (builtin:... for the embedded data)",
    "format_score": "score of a well-formed but wrong answer",
    "gamma": "discount factor",
    "horizon": "adaptive KL controller's horizon in steps",
    "kl_coef": "weight of the KL penalty in the token rewards (verl's kl_ctrl.kl_coef)",
    "kl_loss_coef": "weight of the KL loss to the reference (GRPO; with ref_log_prob wired)",
    "kl_loss_type": "KL estimator of the loss: kl (k1), abs, mse (k2), low_var_kl (k3)",
    "label_smoothing": "conservative DPO / robust DPO smoothing epsilon",
    "lam": "GAE lambda",
    "length_coef": "penalty per token for fn length_penalty",
    "loss_agg_mode": "how token losses are averaged (verl's loss_agg_mode)",
    "loss_type": "DPO loss variant (sigmoid: the paper's; TRL's names)",
    "max_prompt_length": "prompt tokens kept; binds P",
    "max_response_length": "response tokens kept; binds T",
    "micro_batch_size": "sequences per forward on one rank; null: the rank's whole batch",
    "norm_by_std": "divide by the group's std (GRPO); false: mean-centred only (Dr. GRPO)",
    "penalty": "KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3)",
    "penalty_factor": "the penalty at the full budget (L_max): 0 down to -penalty_factor",
    "prompt_key": "column holding the prompt (text or chat messages)",
    "shuffle": "reshuffle the rows every epoch (seeded by the run's seed)",
    "target_length": "length in tokens fn length_penalty aims at; null: shorter is better",
    "temperature": "softmax temperature of sampling (0: greedy)",
    "logprob.temperature": "score at this temperature (the rollout's, as verl does)",
    "top_p": "nucleus sampling: smallest set of tokens with this much mass (1: off)",
    "whiten": "whiten the advantages over the batch's valid tokens",
}
"""The meaning of params several kinds share, written once; `kind.param` when a kind's
differs. A param declared with its own doc keeps it."""


def _documented(kind: KindSpec) -> KindSpec:
    return replace(kind, params=tuple(
        p if p.doc else replace(p, doc=_PARAM_DOCS.get(f"{kind.name}.{p.name}",
                                                       _PARAM_DOCS.get(p.name, "")))
        for p in kind.params))


BUILTIN_KINDS: dict[str, KindSpec] = {k.name: _documented(k) for k in _KINDS + _FILTER_KINDS}
"""Every built-in kind by name."""


def _loss(name: str, doc: str, *params: ParamSpec) -> LossSpec:
    return LossSpec(name, params, f"flowgraph.nodes.policy_losses:{name}", doc)


POLICY_LOSSES: dict[str, LossSpec] = {loss.name: loss for loss in (
    _loss("vanilla", "PPO's clipped objective, dual clip for A < 0 (Schulman et al. 2017)"),
    replace(_loss("gspo", "sequence-level importance ratio (Zheng et al. 2025)"),
            per_sequence=True),
    _loss("cispo", "clipped importance weight on the log-prob gradient (MiniMax 2025)"),
    _loss("gpg", "-A log pi, no ratio (Chu et al. 2025)"),
    _loss("clip_cov", "PPO with high-covariance tokens' gradients cut (Cui et al. 2025)",
          _f("clip_cov_ratio", 0.0002, "share of tokens whose gradient is cut (highest "
             "covariance)", minimum=0.0),
          _f("clip_cov_lb", 1.0, "lower covariance bound of the tokens that may be cut"),
          _f("clip_cov_ub", 5.0, "upper covariance bound of the tokens that may be cut")),
    _loss("kl_cov", "-A rho plus |log rho| on high-covariance tokens (Cui et al. 2025)",
          _f("kl_cov_ratio", 0.0002, "share of tokens given the KL term (highest "
             "covariance)", minimum=0.0),
          _f("ppo_kl_coef", 1.0, "weight of |log ratio| on those tokens")),
)}
"""The built-in policy losses of `ppo_actor_update` (`flowgraph.nodes.policy_losses`)."""
