"""``qkv lab FILE.toml -o DIR``: every variant of a lab file trained for every seed, compared
with the first variant (the baseline) by a 95 % Welch t interval over the seeds.

``labfile`` reads and checks the file, ``worker`` trains one run, ``runner`` schedules the
runs (in this process or in parallel processes), ``results`` writes ``results.json`` and the
text table, ``report`` the offline ``report.html``, ``stats`` holds the interval.
"""
