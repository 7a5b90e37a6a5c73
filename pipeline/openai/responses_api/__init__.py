"""OpenAI's Responses API (`/v1/responses`) over the chat path: a request read into a chat
request (request.py), a chat answer written back as a Response (answer.py) or as the Responses
stream's events (events.py). Pure: Serve's route and the Batch API's lines both use it."""

from pipeline.openai.responses_api.answer import response_body, response_id
from pipeline.openai.responses_api.events import ResponseEvents, frame
from pipeline.openai.responses_api.request import Translation, translate

__all__ = ["ResponseEvents", "Translation", "frame", "response_body", "response_id", "translate"]
