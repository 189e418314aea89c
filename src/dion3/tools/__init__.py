"""The command-line tools beside the library: `dion3 bench` (bench/), `dion3 plan` (plan/),
`dion3 compare` and its small-GPT training (train/), the quality study (study.py), the
`dion3` command itself (cli.py), the one spelling of each Dion3 setting they all print
(setting_names.py) and the one registry of the model names they take (models.py). They import
the library; the library never imports them."""
