"""A training run, from the command's checks to the last step: what is refused before any work
(preflight), the choice between running here and starting the agent (launch), what every rank runs
(worker), the ordered walk that decides every `auto` beyond the machine (choices), and the loop
(trainer) with the pieces it steps through."""
