# Two commands set up a fresh machine that has python3 and pip:
#   make demo   install, then train the built-in demo (about 2½ minutes on 2 AVX2 cores, less with AVX-512)
#   make test   install with the test tools, then run the test suite (what CI runs; its budget: README, Tests)
#   make test-fast  the tests that start no training process or agent (a developer's loop, ≤ 3 minutes)
#   make demo-sft  the demo, then supervised fine-tuning of its model on chat data (configs/demo-sft.yaml)
#   make demo-dpo  the SFT demo, then DPO of its model with LoRA on preference pairs (configs/demo-dpo.yaml)
#   make demo-kto  the SFT demo, then KTO of its model with LoRA on thumbs-up/down answers (configs/demo-kto.yaml)
#   make demo-reward  the SFT demo, then a LoRA reward model on its model, its held-out accuracy (configs/demo-reward.yaml)
#   make demo-grpo  the SFT demo, then online RL (GRPO, LoRA) of its model against a format reward (configs/demo-grpo.yaml)
VENV ?= .venv
# mlflow is left out: with it installed, DeepSpeed's autotuner imports it into every zero3 rank
# (about 0.1 GiB more RSS, which the plan-vs-measured test would count). Its test skips without it.
EXTRAS_TEST ?= dev,deepspeed,tensorboard,wandb,sft-peer,eval

.PHONY: demo demo-sft demo-dpo demo-kto demo-reward demo-grpo test test-fast install install-test install-mpi

# tcmalloc too (apt, as root; a note without): the allocator every rank is preloaded with.
install:
	bash scripts/install.sh
	bash scripts/install-tcmalloc.sh

install-test:
	bash scripts/install.sh $(EXTRAS_TEST)

# MPICH and Open MPI (apt, as root) for the real-mpirun tests; they skip without them.
install-mpi:
	bash scripts/install-mpi.sh

demo: install
	$(VENV)/bin/cputrain train

demo-sft: install
	test -f runs/default/model/config.json || $(VENV)/bin/cputrain train
	$(VENV)/bin/cputrain train configs/demo-sft.yaml
	$(VENV)/bin/cputrain generate runs/demo-sft --chat 'What is The "assert" statement in Python?' --temperature 0

demo-dpo: install
	test -f runs/default/model/config.json || $(VENV)/bin/cputrain train
	test -f runs/demo-sft/model/config.json || $(VENV)/bin/cputrain train configs/demo-sft.yaml
	$(VENV)/bin/cputrain train configs/demo-dpo.yaml

demo-kto: install
	test -f runs/default/model/config.json || $(VENV)/bin/cputrain train
	test -f runs/demo-sft/model/config.json || $(VENV)/bin/cputrain train configs/demo-sft.yaml
	$(VENV)/bin/cputrain train configs/demo-kto.yaml

demo-reward: install
	test -f runs/default/model/config.json || $(VENV)/bin/cputrain train
	test -f runs/demo-sft/model/config.json || $(VENV)/bin/cputrain train configs/demo-sft.yaml
	$(VENV)/bin/cputrain train configs/demo-reward.yaml
	$(VENV)/bin/cputrain eval runs/demo-reward

demo-grpo: install
	test -f runs/default/model/config.json || $(VENV)/bin/cputrain train
	test -f runs/demo-sft/model/config.json || $(VENV)/bin/cputrain train configs/demo-sft.yaml
	$(VENV)/bin/cputrain train configs/demo-grpo.yaml

# Two test processes (pytest-xdist), a test file each at a time so its module fixtures are made
# once: 1,201 s against 1,690 s serial on 2 cores (tests/harness/README.md). Tests marked
# `alone` run with nothing beside them.
test: install-test
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --durations=25

# Installs only when the venv lacks the test tools or the project's install files changed.
$(VENV)/.installed-test: pyproject.toml scripts/install.sh
	bash scripts/install.sh $(EXTRAS_TEST)
	touch $@

test-fast: $(VENV)/.installed-test
	$(VENV)/bin/python -m pytest -q -m "not slow" --durations=10
