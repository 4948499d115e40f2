"""Search tools over variants of one scenario: the variant runner (variants), the OOM doctor
(doctor) and the configuration tuner (tune). They sit above the result and the report: they
import zsim.result and zsim.report, never the reverse."""
