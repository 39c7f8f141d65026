"""Stop strings on streamed text: a stream never shows text past a stop string, even when the stop
string arrives split over several cycles. The one implementation is answer.StopText (the answer
pipeline applies it for every front end); it is named here too for the server's readers."""
from ..answer import StopText

__all__ = ["StopText"]
