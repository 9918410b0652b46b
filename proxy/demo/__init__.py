"""``sluice demo``: a retry storm on a local fake LLM provider, without and with Sluice.

Nothing here is on the request path. :mod:`proxy.demo.fakellm` is the degrading provider,
:mod:`proxy.demo.fleet` the simulated agents (the openai SDK's retry rules, under an agent
framework's step retries), :mod:`proxy.demo.storm` the scenario, the Sluice config tuned for
it, the runs and their summary, and :mod:`proxy.demo.cli` the command. ``bench/storm.py``
reuses all of it with more knobs and repeats.
"""
