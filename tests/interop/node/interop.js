// A Node.js client of rabbit-delay's wire contract: amqplib only, nothing of the project.
// Driven by tests/integration/test_interop_node.py; everything it knows of a topology is
// what a team in another language would read in its TOML file (namespace, version, tier
// names and delays, shard counts, queue names) and the contract (docs/ARCHITECTURE.md,
// "Names on the broker"; rabbit_delay/_envelope.py `outgoing()` for the headers).
//
//   node interop.js shards N ID...      the shard each id picks among N: one JSON array
//   node interop.js publish URL         publishes the jobs of a JSON spec read on stdin
//   node interop.js consume URL QUEUE COUNT TIMEOUT_MS
//                                       prints "ready" once consuming, then one JSON
//                                       document: every message received
'use strict';

const amqp = require('amqplib');

// -- names (the contract: `<namespace>.v<version>.<kind>...`) ------------------------------

function prefix(namespace, version) {
  return `${namespace}.v${version}`;
}

// The tier exchange of shard `shard` (shard 0 keeps the tier's own name).
function tierExchange(namespace, version, tier, shard) {
  const base = `${prefix(namespace, version)}.delay.${tier}`;
  return shard ? `${base}.${shard}` : base;
}

// The routing key unique to a business queue: its full name.
function queueKey(namespace, version, queue) {
  return `${prefix(namespace, version)}.q.${queue}`;
}

// -- the shard rule: CRC-32 (IEEE 802.3, as zlib.crc32) of the id's UTF-8 bytes, modulo ----

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();

function crc32(bytes) {
  let crc = 0xffffffff;
  for (const byte of bytes) crc = CRC_TABLE[(crc ^ byte) & 0xff] ^ (crc >>> 8);
  return (crc ^ 0xffffffff) >>> 0;
}

function shardIndex(messageId, shards) {
  return shards > 1 ? crc32(Buffer.from(messageId, 'utf8')) % shards : 0;
}

// -- publish -------------------------------------------------------------------------------

// spec: {namespace, version, jobs: [{message_id, tier, tier_ms, shards, queue, body}]}
async function publish(url, spec) {
  const connection = await amqp.connect(url, { clientProperties: { connection_name: 'rd-interop-node-publisher' } });
  const channel = await connection.createConfirmChannel();
  const returned = [];
  channel.on('return', (msg) => returned.push(msg.properties.messageId));
  const sent = [];
  for (const job of spec.jobs) {
    const now = Date.now();
    const shard = shardIndex(job.message_id, job.shards);
    const exchange = tierExchange(spec.namespace, spec.version, job.tier, shard);
    const routingKey = queueKey(spec.namespace, spec.version, job.queue);
    const headers = {
      'rd-due-at': now + job.tier_ms, // UTC epoch ms
      'rd-asked-due-at': now + job.tier_ms,
      'rd-delay-ms': job.tier_ms,
      'rd-tier': job.tier,
      'rd-attempt': 1,
      'rd-target': routingKey,
    };
    channel.publish(exchange, routingKey, Buffer.from(JSON.stringify(job.body), 'utf8'), {
      persistent: true,
      mandatory: true,
      messageId: job.message_id,
      contentType: 'application/json',
      timestamp: Math.floor(now / 1000),
      headers,
    });
    sent.push({ message_id: job.message_id, exchange, routing_key: routingKey, due_at: headers['rd-due-at'] });
  }
  await channel.waitForConfirms(); // rejects if the broker nacked any
  await channel.close();
  await connection.close();
  process.stdout.write(JSON.stringify({ sent, returned }) + '\n');
}

// -- consume -------------------------------------------------------------------------------

async function consume(url, queue, count, timeoutMs) {
  const connection = await amqp.connect(url, { clientProperties: { connection_name: 'rd-interop-node-consumer' } });
  const channel = await connection.createChannel();
  await channel.prefetch(50);
  const received = [];
  let done;
  const finished = new Promise((resolve) => { done = resolve; });
  const timer = setTimeout(() => done('timeout'), timeoutMs);
  await channel.consume(queue, (msg) => {
    if (msg === null) return done('cancelled');
    const at = Date.now();
    received.push({
      message_id: msg.properties.messageId,
      received_at: at,
      redelivered: msg.fields.redelivered,
      delivery_mode: msg.properties.deliveryMode,
      content_type: msg.properties.contentType,
      headers: msg.properties.headers,
      body: msg.content.toString('utf8'),
    });
    channel.ack(msg);
    if (received.length >= count) done('count');
  });
  process.stdout.write('ready\n');
  const why = await finished;
  clearTimeout(timer);
  // A short grace: a message beyond `count` (a duplicate) would show up here.
  await new Promise((resolve) => setTimeout(resolve, 300));
  await channel.close();
  await connection.close();
  process.stdout.write(JSON.stringify({ why, received }) + '\n');
}

// -- main ----------------------------------------------------------------------------------

async function readStdin() {
  const chunks = [];
  for await (const chunk of process.stdin) chunks.push(chunk);
  return Buffer.concat(chunks).toString('utf8');
}

async function main(argv) {
  const [command, ...args] = argv;
  if (command === 'shards') {
    const [shards, ...ids] = args;
    process.stdout.write(JSON.stringify(ids.map((id) => shardIndex(id, Number(shards)))) + '\n');
  } else if (command === 'publish') {
    await publish(args[0], JSON.parse(await readStdin()));
  } else if (command === 'consume') {
    await consume(args[0], args[1], Number(args[2]), Number(args[3]));
  } else {
    throw new Error(`unknown command ${command}: shards, publish or consume`);
  }
}

main(process.argv.slice(2)).catch((err) => {
  process.stderr.write(`interop.js: ${err.stack || err}\n`);
  process.exit(1);
});
