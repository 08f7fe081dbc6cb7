import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import { statusText } from '../src/format';
import {
  FreshOutputs,
  isStatusPayload,
  ISidebarAnswer,
  readSidebarData,
  readStatusComm,
  REQUESTS,
  SIDEBAR_MIME,
  sidebarOutputModelId,
  STATUS_TARGET,
  WIDGET_VIEW_MIME
} from '../src/protocol';
import { readFixture } from './fixtures';

/** tests/fixtures/status_protocol.json: what the kernel sends (checked on the Python side too). */
interface IProtocol {
  status_target: string;
  sidebar_mime: string;
  widget_view_mime: string;
  requests: string[];
  status_payloads: { data: unknown; status_text: string }[];
  sidebar_answers: { data: unknown; answer: ISidebarAnswer }[];
}

const PROTOCOL = readFixture<IProtocol>('status_protocol.json');

describe('the names shared with the kernel', () => {
  it('are the ones gpumem.panel.frontend uses', () => {
    assert.equal(STATUS_TARGET, PROTOCOL.status_target);
    assert.equal(SIDEBAR_MIME, PROTOCOL.sidebar_mime);
    assert.equal(WIDGET_VIEW_MIME, PROTOCOL.widget_view_mime);
  });

  it('ask only what the kernel answers', () => {
    assert.deepEqual([...REQUESTS], PROTOCOL.requests);
  });
});

describe('readStatusComm', () => {
  for (const [i, c] of PROTOCOL.status_payloads.entries()) {
    it(`reads the kernel's status payload ${i} and shows "${c.status_text}"`, () => {
      const message = readStatusComm(c.data);
      assert.ok(message?.kind === 'status', JSON.stringify(message));
      assert.equal(statusText(message.payload), c.status_text);
    });
  }

  for (const c of PROTOCOL.sidebar_answers) {
    it(`reads the sidebar answer ${JSON.stringify(c.data)}`, () => {
      assert.deepEqual(readStatusComm(c.data), {
        kind: 'sidebar',
        answer: c.answer
      });
    });
  }

  it('leaves what it does not know unread', () => {
    for (const data of [
      null,
      undefined,
      'status',
      42,
      [],
      {},
      { devices: 'none' },
      { sidebar_model_id: 7 },
      { sidebar_error: null }
    ]) {
      assert.equal(readStatusComm(data), null, JSON.stringify(data));
    }
  });

  it('takes a payload by its devices list', () => {
    assert.ok(isStatusPayload({ devices: [], cuda_in_use: false }));
    assert.ok(!isStatusPayload({ cuda_in_use: false }));
    assert.ok(!isStatusPayload(null));
  });
});

describe('a sidebar output', () => {
  const content = (modelId: unknown) => ({
    data: {
      [SIDEBAR_MIME]: { model_id: modelId },
      'text/plain': 'GPU memory panel'
    }
  });

  it('names its panel in each kind of output message', () => {
    for (const type of [
      'display_data',
      'execute_result',
      'update_display_data'
    ]) {
      assert.equal(sidebarOutputModelId(type, content('m1')), 'm1', type);
    }
  });

  it('is not read from other messages, other outputs or a malformed one', () => {
    assert.equal(sidebarOutputModelId('stream', content('m1')), null);
    assert.equal(sidebarOutputModelId('execute_input', content('m1')), null);
    assert.equal(
      sidebarOutputModelId('display_data', { data: { 'text/plain': 'x' } }),
      null
    );
    assert.equal(sidebarOutputModelId('display_data', {}), null);
    assert.equal(sidebarOutputModelId('display_data', null), null);
    assert.equal(sidebarOutputModelId('display_data', content(3)), null);
    assert.equal(sidebarOutputModelId('display_data', content('')), null);
  });

  it('gives its model id to the renderer, or null when it has none', () => {
    assert.equal(readSidebarData({ model_id: 'abc' }), 'abc');
    assert.equal(readSidebarData({ model_id: '' }), null);
    assert.equal(readSidebarData({}), null);
    assert.equal(readSidebarData('abc'), null);
    assert.equal(readSidebarData(null), null);
  });
});

describe('FreshOutputs', () => {
  it('answers each fresh output once', () => {
    const fresh = new FreshOutputs();
    fresh.add('a');
    assert.ok(fresh.has('a'));
    assert.ok(fresh.take('a'));
    assert.ok(!fresh.has('a'));
    assert.ok(!fresh.take('a'));
    assert.ok(!fresh.take('never seen'));
  });

  it('keeps the newest 32 and forgets all at a kernel change', () => {
    const fresh = new FreshOutputs();
    for (let i = 0; i < 40; i++) {
      fresh.add(`m${i}`);
      fresh.add('kept'); // seen again and again: the newest each time
    }
    const kept = Array.from({ length: 40 }, (_, i) => `m${i}`).filter(id =>
      fresh.has(id)
    );
    assert.deepEqual(
      kept,
      Array.from({ length: 31 }, (_, i) => `m${i + 9}`)
    );
    assert.ok(fresh.has('kept'));
    fresh.clear();
    assert.ok(!fresh.has('kept') && !fresh.has('m39'));
  });
});
