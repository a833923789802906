# Two commands set up a fresh machine that has python3 and pip:
#   make demo   install, then train the built-in demo (about 3 minutes on 2 cores)
#   make test   install with the test tools, then run the test suite
VENV ?= .venv
# mlflow is left out: with it installed, DeepSpeed's autotuner imports it into every zero3 rank
# (about 0.1 GiB more RSS, which the plan-vs-measured test would count). Its test skips without it.
EXTRAS_TEST ?= dev,deepspeed,tensorboard,wandb

.PHONY: demo test install install-test

install:
	bash scripts/install.sh

install-test:
	bash scripts/install.sh $(EXTRAS_TEST)

demo: install
	$(VENV)/bin/cputrain train

test: install-test
	$(VENV)/bin/python -m pytest -q
