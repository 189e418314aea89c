"""The command-line tools beside the library: `dion3 bench` (bench/), `dion3 plan` (plan/),
`dion3 compare` and its small-GPT training (train/), the quality study (study.py) and the
`dion3` command itself (cli.py). They import the library; the library never imports them."""
