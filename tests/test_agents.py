"""The OpenAI Agents SDK, unchanged, against a CPU server (tiny-llama, random weights): what it sends by default
is the Responses API (/v1/responses). A required tool is called with arguments of its schema and its result
ends the run; an agent with an output type gets a reply its pydantic model validates, streamed. (A tool's result
sent back, then an answer: the byte-level tokenizer's prompt of the tools leaves the 1024-token context no room.)"""
import asyncio
from typing import Literal

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI
from pydantic import BaseModel

from conftest import MODEL, serve_alone


class Answer(BaseModel):
    sunny: bool
    city: Literal["Paris", "Oslo"]


def test_agents_sdk_calls_tools_and_answers_in_its_output_type(tmp_path):
    set_tracing_disabled(True)
    srv = serve_alone(tmp_path, "agents")
    try:
        model = OpenAIResponsesModel(MODEL, AsyncOpenAI(base_url=srv.wait_ready().url + "/v1", api_key="none"))
        calls = []

        @function_tool
        def get_weather(city: Literal["Paris", "Oslo"]) -> str:
            """The weather in a city."""
            calls.append(city)
            return f"18 C in {city}"

        caller = Agent(name="caller", instructions="Answer.", tools=[get_weather], model=model,
                       model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0),
                       tool_use_behavior="stop_on_first_tool")
        answerer = Agent(name="answerer", instructions="Answer.", model=model, output_type=Answer,
                         model_settings=ModelSettings(temperature=0))
        async def run():
            called = await Runner.run(caller, "Weather in Paris?")
            streamed = Runner.run_streamed(answerer, "Is it sunny?")
            events = [event async for event in streamed.stream_events()]
            return called, streamed, events

        called, streamed, events = asyncio.run(run())
        assert calls in (["Paris"], ["Oslo"]) and called.final_output == f"18 C in {calls[0]}"
        assert isinstance(streamed.final_output, Answer) and events
    finally:
        srv.kill()
