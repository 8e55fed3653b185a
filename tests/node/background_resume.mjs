// One background response through the official `openai` npm package, dropped and resumed
// (tests/test_responses_api.py runs it against the spawned stack and checks what it prints):
//   responses.create({background: true, stream: true}) -> read up to the first text delta, drop
//   the connection -> responses.retrieve(id, {stream: true, starting_after: n}) -> the rest;
// then a whole replay and a poll, to compare with. Prints one JSON object on stdout.
// Usage: node background_resume.mjs BASE_URL API_KEY MODEL INPUT MAX_OUTPUT_TOKENS
import OpenAI from "openai";

const [baseURL, apiKey, model, input, maxTokens] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 120_000 });

async function collect(stream) {
  const events = [];
  for await (const event of stream) events.push(event);
  return events;
}

const first = [];
const stream = await client.responses.create({
  model, input, max_output_tokens: Number(maxTokens), temperature: 0, background: true, stream: true,
});
for await (const event of stream) {
  first.push(event);
  if (event.type === "response.output_text.delta" || event.type.endsWith("completed")) break;
}
stream.controller.abort();          // the drop (leaving the loop has closed it already; this says so)

const id = first[0].response.id;
const after = first[first.length - 1].sequence_number;
const rest = await collect(await client.responses.retrieve(id, { stream: true, starting_after: after }));
const whole = await collect(await client.responses.retrieve(id, { stream: true }));
const polled = await client.responses.retrieve(id);
process.stdout.write(JSON.stringify({ id, first, rest, whole, polled }) + "\n");
