"""The engine's loop and its data.

* :mod:`.engine`: ``Engine``, which steps the scheduler and the runner;
* :mod:`.request`: a request's state; :mod:`.inputs`: prompts as token ids;
* :mod:`.outputs`: the plain data between the parts (``SchedulerOutput``,
  ``RunnerOutput``, ``BlockCopy``);
* :mod:`.trace`: one row per step; :mod:`.engine_stats`: each step's
  statistics for stat loggers;
* :mod:`.stop_strings`: stop strings on the text; :mod:`.checks`: argument
  checks; :mod:`.device`: the device choice.
"""
